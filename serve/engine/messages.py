"""The plain messages between an engine front end and the core loop.

Commands go to the core (add / abort / stop a sequence / stop); replies come back (a
step's token deltas, a refused request, and, from a core process, ready or failed). All
are plain data, so the same messages cross a thread's queue or a process's pipe.

On a pipe, a step's deltas, the one message every step sends, go as MessagePack
(`encode_step`); the rest, a few per request or per second, are pickled dataclasses. The
pipe is the process tree's own, never a network port. `decode_reply` tells them apart.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import msgspec

from serve.lora_request import LoRARequest
from serve.multimodal_inputs import MultiModalInput
from serve.outputs import EngineStats, StepTimes
from serve.pooling_params import ModelPooling
from serve.sampling_params import SamplingParams
from serve.scheduler.output_deltas import RequestDelta

# -- commands: front end → core ---------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    priority: int = 0  # --scheduling-policy priority: lower runs first
    lora: LoRARequest | None = None
    mm_inputs: tuple[MultiModalInput, ...] = ()  # its prompt's images, processed


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class StopSequence:
    """The front end found a stop string in sequence `index` of a request whose other
    sequences run on (n > 1, best_of): finish that one alone and free its blocks. Its
    tokens sampled since are dropped by the front end."""

    request_id: str
    index: int  # as in SeqDelta.index


@dataclass(frozen=True)
class Stop:
    """Leave the loop; requests still running are dropped (the front end fails them)."""


Command = AddRequest | AbortRequest | StopSequence | Stop

# -- replies: core → front end ----------------------------------------------------------
# A step's token deltas travel as a bare list[RequestDelta] (output_deltas.py), the one
# message per step.

_step_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(list[RequestDelta])
# Every pickle of protocol 2 or later opens with this byte (PROTO); in MessagePack it is
# an empty map, which a step's message (an array) never is.
_PICKLE_PROTO = 0x80


def encode_step(deltas: list[RequestDelta]) -> bytes:
    """A step's deltas for a pipe. 256 one-token deltas encode in ~20-40 µs and decode in
    ~60-110; pickled as the dataclasses they were, ~650 and ~850."""
    return _step_encoder.encode(deltas)


def decode_reply(data: bytes) -> object:
    """A reply read off a pipe: a step's deltas (`encode_step`), or any other pickled."""
    if data[0] == _PICKLE_PROTO:
        return pickle.loads(data)
    return _step_decoder.decode(data)


@dataclass(frozen=True)
class RequestFailed:
    """A request failed alone when it arrived: refused as invalid (a ValueError), or,
    `internal`, adding it raised something else (a bug, logged with its traceback)."""

    request_id: str
    message: str
    internal: bool = False


@dataclass(frozen=True)
class CoreReady:
    """A core process has loaded the model: what the API process needs to validate and
    answer requests without it."""

    model_path: Path
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    eos_token_ids: frozenset[int]
    pooling: ModelPooling  # the model's embedding defaults and `dimensions` it allows


@dataclass(frozen=True)
class CoreFailed:
    """A core process could not start, or its loop died: the cause, to raise or log in
    the API process. `error_type` is the exception's class name (ValueError, OSError, …)."""

    error_type: str
    message: str


@dataclass(frozen=True)
class CoreStats:
    """The core's state and counters at one moment, for /metrics: sent at most every
    STATS_PUBLISH_S while it is busy, and once more when it goes idle."""

    engine: EngineStats
    num_generated_tokens: int
    step_times: StepTimes
