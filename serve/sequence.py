"""A request's sequence: its tokens, how many of them have KV in the cache, its status.

Writers (one per field): the scheduler writes `status` and `num_computed_tokens`; the
engine appends tokens and sets `finish_reason`; the detokenizer writes the text fields.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from serve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self is SequenceStatus.FINISHED


class FinishReason(str, enum.Enum):
    """The OpenAI `finish_reason` values; `str` so they serialise as the bare word."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # Top-`logprobs` alternatives per output token, when the request asked for them.
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # Tokens whose K/V are in the cache. Reset to 0 by a recompute preemption.
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    # Incremental detokenization state (owned by the detokenizer).
    output_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to be fed through the model before the next one can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(self.output_logprobs))

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_ids_between(self, start: int, end: int | None = None) -> list[int]:
        """`all_token_ids[start:end]` without building the whole list (a per-step hot path)."""
        if end is not None and end <= start:
            return []
        num_prompt = self.num_prompt_tokens
        if start >= num_prompt:
            stop = None if end is None else end - num_prompt
            return self.output_token_ids[start - num_prompt : stop]
        if end is not None and end <= num_prompt:
            return self.prompt_token_ids[start:end]
        stop = None if end is None else end - num_prompt
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop]

    def token_at(self, position: int) -> int:
        if position < self.num_prompt_tokens:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - self.num_prompt_tokens]

    def append_token(
        self, token_id: int, logprob: float, top_logprobs: dict[int, float] | None
    ) -> None:
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)
