"""EngineClient: what the API uses of an engine, and the error it raises once dead.

Two engines meet it: `EngineCoreClient` (core_client.py, the default: the core in its own
process) and `AsyncEngine` (async_engine.py, the core on a thread of this process).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from serve.engine.messages import CoreStats
from serve.engine.request_metrics import RequestMetrics
from serve.lora_request import LoRARequest
from serve.multimodal_inputs import MultiModalInput
from serve.outputs import OutputKind, RequestOutput, request_error_message
from serve.sampling_params import SamplingParams, StructuredOutputsParams


class EngineDeadError(RuntimeError):
    """The engine has stopped; no request can be served until a restart."""


class RequestError(RuntimeError):
    """The engine failed one request (an exception while processing it); the request has
    ended and freed its blocks, and every other request runs on."""


class RequestTimeoutError(RuntimeError):
    """A request ran past its deadline (`--request-timeout`): it was aborted."""


class EngineStartError(RuntimeError):
    """The engine core could not start for a reason other than a bad setting or model (those
    raise ValueError, OSError and the like): it crashed, or the system killed it."""


__all__ = [
    "EngineClient",
    "EngineDeadError",
    "EngineStartError",
    "RequestError",
    "request_error_message",
]


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def model_path(self) -> Path: ...

    @property
    def is_alive(self) -> bool:
        """False once the engine has died or been shut down (`/health` reads it)."""

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine is dead; None while it runs."""

    @property
    def core_stats(self) -> CoreStats | None:
        """The core's latest state and counters (None before its first report)."""

    @property
    def request_metrics(self) -> RequestMetrics:
        """Latencies and sizes of the requests served so far (/metrics reads them)."""

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        timeout_s: float | None = None,
        priority: int = 0,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
        mm_inputs: tuple[MultiModalInput, ...] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes: everything so far at each, what is
        new since the last, or the finished one alone (`output_kind`). Closing the
        iterator early aborts the request. Raises ValueError for a request the engine
        refuses, RequestError when processing this request failed, RequestTimeoutError
        (and aborts it) once it has run `timeout_s`, and EngineDeadError (also mid-stream)
        when the engine is gone."""

    def check_token_ids(self, token_ids: list[int], what: str = "Token ids") -> None:
        """ValueError unless every id is in the model's vocabulary."""

    def check_params(self, params: SamplingParams) -> None:
        """ValueError (starting with the field's name) for what SamplingParams cannot check
        alone: token ids against the vocabulary, logprob counts against --max-logprobs."""

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """ValueError for an invalid grammar, before the request that carries it starts."""

    async def check_lora(self, lora: LoRARequest) -> None:
        """ValueError unless the adapter loads onto this model (and LoRA is enabled),
        before a request uses it or the server lists it."""

    def shutdown(self) -> None:
        """Stop the engine; running requests fail with EngineDeadError. Idempotent."""
