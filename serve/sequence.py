"""A request's sequences: their tokens, how many have KV in the cache, their status.

A request is a `SequenceGroup`. It starts as one sequence; when its prompt has been
computed, parallel sampling (`best_of` > 1) and beam search fork it into several that
share the prompt's KV blocks.

These are the scheduler's (serve/scheduler/): it writes `status` and the token counts
(`num_computed_tokens`, `num_scheduled_tokens`, `num_pending_tokens`) as it schedules,
and, as it reads each step's output (`update_from_output`), appends tokens (which settles
a pending one), forks, and sets `finish_reason`; the output deltas record what was sent.
The workers keep mirrors of their own (serve/worker/sequence_mirror.py).

With async scheduling the next step is scheduled while the current one runs: a sequence
then has tokens scheduled but not yet computed, and a token scheduled to be sampled but
not yet appended. The scheduler plans from `num_planned_tokens` and
`num_unscheduled_tokens`, which count them; `num_computed_tokens` stays what the KV cache
holds. Text is not here: the front end decodes it (engine/output_processor.py).
"""

from __future__ import annotations

import copy
import enum
import time
from dataclasses import dataclass, field

from serve.lora_request import LoRARequest
from serve.multimodal_inputs import MultiModalInput
from serve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()  # preempted with its KV blocks moved to the CPU swap space
    FINISHED = enum.auto()


# The member itself, for the per-sequence checks of every step: an Enum member read
# through its class costs ~5x a module global.
_FINISHED = SequenceStatus.FINISHED


class FinishReason(str, enum.Enum):
    """The OpenAI `finish_reason` values; `str` so they serialise as the bare word."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)  # identity: two sequences are never the same by value
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # The seed of this sequence's own random stream: the request's seed + the sequence's
    # index among the request's samples, so sample i of an n-way request draws exactly
    # what a lone request with seed + i would. None: the engine's shared stream.
    seed: int | None = None
    # What besides its tokens decides its K/V, for the prefix cache: its adapter ("" none).
    cache_key: str = ""
    # Its prompt's images (their runs of placeholder tokens take the images' embeddings):
    # the prefix cache keys a block by the images it holds; the workers get the pixels.
    mm_inputs: tuple[MultiModalInput, ...] = ()

    output_token_ids: list[int] = field(default_factory=list)
    # Each output token's logprob, when its request needs them
    # (`SamplingParams.needs_logprobs`); empty otherwise.
    output_logprobs: list[float] = field(default_factory=list)
    # Top-`logprobs` alternatives per output token, when the request asked for them, and
    # each sampled token's rank (not for beams: their entries are ranked by their order).
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    output_ranks: list[int] = field(default_factory=list)
    # Beam search: the running beam's score (its cumulative logprob, summed in float32).
    beam_score: float = 0.0
    # Tokens whose K/V are in the cache. Reset to 0 by a recompute preemption.
    num_computed_tokens: int = 0
    # Tokens after those that scheduled steps are computing (0 between serial steps).
    num_scheduled_tokens: int = 0
    # Tokens that scheduled steps will sample, not yet appended (at most one a step).
    num_pending_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it

    # What the core has sent the front end of this sequence (owned by output_deltas.py).
    num_sent_tokens: int = 0
    is_finish_sent: bool = False

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if self.seed is None:
            self.seed = self.sampling_params.seed

    def fork(self, seq_id: int, seed: int | None = None) -> Sequence:
        """A copy with its own id and token lists (the prompt list is shared: it never
        changes); the block manager forks the KV blocks separately."""
        child = copy.copy(self)
        child.seq_id, child.seed = seq_id, seed
        child.num_sent_tokens, child.is_finish_sent = 0, False  # new to the front end
        child.output_token_ids = list(self.output_token_ids)
        child.output_logprobs = list(self.output_logprobs)
        child.output_top_logprobs = list(self.output_top_logprobs)
        child.output_ranks = list(self.output_ranks)
        return child

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
    def num_planned_tokens(self) -> int:
        """Tokens computed or being computed: where the next scheduled step starts."""
        return self.num_computed_tokens + self.num_scheduled_tokens

    @property
    def num_unscheduled_tokens(self) -> int:
        """Tokens no step is computing yet, counting the ones still being sampled."""
        return self.num_tokens + self.num_pending_tokens - self.num_planned_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

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
        self,
        token_id: int,
        logprob: float | None,
        top_logprobs: dict[int, float] | None,
        rank: int | None = None,
    ) -> None:
        self.output_token_ids.append(token_id)
        self.num_pending_tokens = max(0, self.num_pending_tokens - 1)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)
        if rank is not None:
            self.output_ranks.append(rank)


@dataclass(eq=False)
class SequenceGroup:
    """One request: the sequences sampled from its prompt, scheduled together."""

    request_id: str
    # Sampling: every sequence, finished ones included, in output order. Beam search: the
    # running beams, best first (finished hypotheses live in the engine's beam search).
    seqs: list[Sequence]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # --scheduling-policy priority: lower runs first (vLLM's convention); 0 otherwise.
    priority: int = 0
    started: bool = False  # scheduled at least once (a preempted request stays started)
    # The scheduler's: prompt tokens the prefix cache held when it was first scheduled
    # (None before), and the times it was preempted.
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    # The scheduler's clock when it was first scheduled, and when its first token came.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Set once the prompt sequence has been forked into `best_of` samples or beams.
    forked: bool = False
    # With `prompt_logprobs`: [None, then one entry per prompt token after the first],
    # filled as the prompt is computed (chunk by chunk), and the prompt tokens' ranks alike.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    # Structured output: the compiled grammar (xgrammar's serialized JSON) the workers
    # constrain each sequence's tokens with.
    grammar: str | None = None
    lora: LoRARequest | None = None  # the adapter its forward passes apply

    def __post_init__(self) -> None:
        self.prompt_token_ids = self.seqs[0].prompt_token_ids

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status is not _FINISHED]

    @property
    def num_live_seqs(self) -> int:
        return sum(1 for s in self.seqs if s.status is not _FINISHED)

    @property
    def max_num_seqs(self) -> int:
        """Sequences this group may run at once: counted against `max_num_seqs` from
        admission, so the fork never overflows the batch."""
        return self.num_live_seqs if self.forked else self.sampling_params.best_of

    @property
    def needs_fork(self) -> bool:
        return not self.forked and self.sampling_params.best_of > 1

    @property
    def is_finished(self) -> bool:
        for s in self.seqs:
            if s.status is not _FINISHED:
                return False
        return True
