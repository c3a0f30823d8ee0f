"""What the engine hands back: one `RequestOutput` per request, as in vLLM."""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace


class OutputKind(enum.Enum):
    """What each output of a request carries (vLLM's `RequestOutputKind`)."""

    CUMULATIVE = "cumulative"  # everything so far, at every step
    # What is new since the previous output. A streamed response sends only that, and a
    # snapshot of a long output every step would cost the front end time in its length.
    DELTA = "delta"
    FINAL_ONLY = "final_only"  # one output, the finished one: a response not streamed


def request_error_message(error: BaseException) -> str:
    """What a client is told when processing its request raised `error` in the engine."""
    return (
        f"The engine failed while processing this request ({type(error).__name__}: {error}). "
        "Other requests were not affected; the server log has the details."
    )


class Logprob(float):
    """One token's logprob as vLLM's offline API gives it: `.logprob`, `.rank` (1 for the
    most likely token; None where unknown) and `.decoded_token`. Still a float, for code
    that reads it as one."""

    __slots__ = ("rank", "decoded_token")

    def __new__(
        cls, logprob: float, rank: int | None = None, decoded_token: str | None = None
    ) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self) -> tuple:
        return Logprob, (float(self), self.rank, self.decoded_token)


def ranked_logprobs(
    entries: dict[int, float],
    num_top: int | None,
    decode: Callable[[int], str | None],
    chosen: int,
    rank: int | None = None,
) -> dict[int, Logprob]:
    """`entries` ({token id: logprob}: the `num_top` most likely tokens and the `chosen`
    one) as `Logprob`s, in vLLM's order and ranks: the chosen token first, then the others
    best first; the top ones ranked by their order, the chosen token outside them by
    `rank` (its place in the vocabulary, from the worker; None: unknown). `num_top` None:
    all are the best."""
    ranked = sorted(entries, key=entries.__getitem__, reverse=True)  # stable on ties
    ranks = {t: i + 1 if num_top is None or i < num_top else rank for i, t in enumerate(ranked)}
    order = [chosen, *(t for t in ranked if t != chosen)] if chosen in entries else ranked
    return {t: Logprob(entries[t], ranks[t], decode(t)) for t in order}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # The sum of its tokens' logprobs; None when the request neither asked for logprobs
    # nor is ranked by them (SamplingParams.needs_logprobs), as in vLLM.
    cumulative_logprob: float | None = None
    # Per output token: {token_id: logprob} with the sampled token and the top alternatives
    # (`Logprob`s, floats with vLLM's fields, from `LLM.generate`).
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # Per output token, with `logprobs`: the sampled token's rank under the model (vLLM's
    # `Logprob.rank`: the tokens at least as likely, itself included). None for beam
    # search, whose entries are all among the best, ranked by their order.
    ranks: list[int] | None = None

    def finished(self) -> bool:
        """A method, as vLLM's `CompletionOutput.finished()` is (`RequestOutput.finished`
        is a field)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # With `prompt_logprobs`: None for the first prompt token (nothing predicts it), then
    # {token_id: logprob} with the prompt token and the top alternatives, per position;
    # and each prompt token's rank there (vLLM's `Logprob.rank`; None for the first).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    # Set when the engine failed this request alone (its other requests ran on): why.
    # The request is finished, its blocks freed; `outputs` may be cut short or empty.
    error: str | None = None
    # A pooling request's vector (its embedding), once finished; its `outputs` hold one
    # empty completion.
    pooled: list[float] | None = None
    # Prompt tokens whose K/V the prefix cache held when the request was first scheduled
    # (vLLM's field); None before the core has scheduled it.
    num_cached_tokens: int | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    def add_delta(self, later: RequestOutput) -> None:
        """Fold the next DELTA output of this request into this one (a reader that fell
        behind sends both as one): texts, tokens and logprobs joined, the rest the later's."""
        mine = {c.index: c for c in self.outputs}
        for new in later.outputs:
            old = mine.get(new.index)
            if old is None:
                self.outputs.append(new)
                continue
            old.text += new.text
            old.token_ids = old.token_ids + new.token_ids
            if old.logprobs is not None and new.logprobs is not None:
                old.logprobs = old.logprobs + new.logprobs
            if old.ranks is not None and new.ranks is not None:
                old.ranks = old.ranks + new.ranks
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
        self.finished = later.finished
        self.error = later.error
        self.pooled = later.pooled
        self.num_cached_tokens = later.num_cached_tokens


class RequestsFailedError(RuntimeError):
    """`LLM.generate` raises it when the engine failed some of its requests (each alone:
    the others ran on). `outputs` holds every request's output, in order, the failed ones
    with their `error`."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        failed = [out for out in outputs if out.error is not None]
        super().__init__(
            f"The engine failed {len(failed)} of {len(outputs)} requests; "
            f"{failed[0].request_id}: {failed[0].error}"
        )
        self.outputs = outputs


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt, shaped as vLLM's (`out.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class BeamSearchSequence:
    """One beam as vLLM's `LLM.beam_search(prompts, BeamSearchParams(...))` returns it:
    `tokens` are the prompt's and the beam's, `text` their decoding together (as vLLM
    decodes it: its `skip_special_tokens`, a stop token's text kept), `logprobs` per output
    token the candidates its step ranked from this beam. `finish_reason` is "stop" (EOS or
    a stop token) or "length", where vLLM leaves it None."""

    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first: `beam_width` of them, as in vLLM."""

    sequences: list[BeamSearchSequence]

    @classmethod
    def of(cls, out: RequestOutput, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        """A finished beam search's `RequestOutput` (its beams asked for `logprobs`) in
        vLLM's shape; `decode` gives `text` from `tokens`."""
        sequences = []
        for beam in out.outputs:
            tokens = out.prompt_token_ids + beam.token_ids
            sequences.append(
                BeamSearchSequence(
                    tokens=tokens,
                    logprobs=beam.logprobs or [],
                    cum_logprob=beam.cumulative_logprob or 0.0,
                    text=decode(tokens),
                    finish_reason=beam.finish_reason,
                    stop_reason=beam.stop_reason,
                )
            )
        return cls(sequences)


@dataclass(frozen=True)
class RequestTimes:
    """A finished request's phases in the core, in seconds (vLLM's request-level
    metrics): waiting to be scheduled, from first scheduled to its first token, and from
    there to its end. Durations, not timestamps: the core's clock is not the front end's."""

    queue_s: float
    prefill_s: float
    decode_s: float


@dataclass
class Histogram:
    """Observations per bucket (not cumulative; the last is above every bound) and their
    sum: plain data, which /metrics exports as a Prometheus histogram."""

    bounds: tuple[float, ...]  # strictly increasing
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self, up_to: float = float("inf")) -> list[tuple[float, int]]:
        """Prometheus' buckets: (le, observations at most le) for the bounds up to
        `up_to`, ending with (inf, all of them)."""
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts):
            if bound > up_to:
                break
            running += n
            out.append((bound, running))
        out.append((float("inf"), self.count))
        return out

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total)


# vLLM's buckets of tokens per engine step: powers of two up to a large batch budget.
ITERATION_TOKENS_BUCKETS = (
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
)  # fmt: skip
QUEUE_TIME_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
MAX_PRIORITY_LABELS = 16  # distinct priorities with their own series; later ones share one


@dataclass
class QueueTimes:
    """Seconds from arrival to first being scheduled, a histogram per priority (the
    scheduler's; plain data for /metrics). `counts[label][i]` counts the waits of at most
    QUEUE_TIME_BUCKETS_S[i] seconds, the last entry all of them."""

    counts: dict[str, list[int]] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)

    def observe(self, priority: int, wait_s: float) -> None:
        label = str(priority)
        if label not in self.counts and len(self.counts) >= MAX_PRIORITY_LABELS:
            label = "other"  # a client's integers must not grow the series without bound
        counts = self.counts.setdefault(label, [0] * (len(QUEUE_TIME_BUCKETS_S) + 1))
        for i, bound in enumerate(QUEUE_TIME_BUCKETS_S):
            if wait_s <= bound:
                counts[i] += 1
        counts[-1] += 1
        self.sums[label] = self.sums.get(label, 0.0) + wait_s

    def copy(self) -> QueueTimes:
        return QueueTimes({k: list(v) for k, v in self.counts.items()}, dict(self.sums))


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counts since start, as vLLM exports them: a draft is one
    sequence's proposals checked in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [j]: drafts whose proposal j (0-based) was accepted.
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position += [0] * (num_proposed - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a draft's step gives its sequence: the accepted proposals and one more."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecDecodeStats:
        return replace(self, accepted_per_position=list(self.accepted_per_position))


@dataclass
class EngineStats:
    """The KV cache and scheduler at one moment (`LLM.stats()`, the stats line, metrics)."""

    num_blocks_total: int
    num_blocks_used: int  # held by at least one sequence
    num_blocks_cached: int  # free, but still holding a known prefix (evictable, LRU)
    peak_num_blocks_used: int  # since the last `reset_peak()`
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found (their K/V not recomputed)
    num_preemptions: int
    kv_waste_fraction: float  # allocated token slots holding no token / allocated slots
    num_running: int = 0  # requests
    num_waiting: int = 0
    num_waiting_for_grammar: int = 0  # of num_waiting, those whose grammar still compiles
    num_swapped: int = 0
    num_cpu_blocks_used: int = 0  # swap space in use
    num_cpu_blocks_total: int = 0  # swap space
    queue_times: QueueTimes = field(default_factory=QueueTimes)
    # Tokens each engine step ran through the model: prompt chunks, decode tokens and the
    # proposals checked (the scheduler's).
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKENS_BUCKETS))
    # --scheduling-policy sjf: the output-length predictor's mean absolute error in tokens
    # (None until it predicts).
    sjf_predictor_mae_tokens: float | None = None
    # --scheduling-policy sjf: the longest any request has waited while later arrivals ran,
    # which --sjf-max-wait-s bounds (None under other policies).
    sjf_longest_passed_over_s: float | None = None
    spec_decode: SpecDecodeStats | None = None  # None: no --speculative-config
    # LoRA adapters by name: how many requests of each run, and wait (swapped ones too).
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@dataclass
class StepTimes:
    """Seconds the engine has spent in each phase of its steps, summed since start.

    `forward_s` is the model's forward pass (with the KV block moves and the logits);
    `busy_fraction` of a window is its forward time over the window's wall time. On CUDA
    the forward is timed on the host, up to the sampler's read of the logits.
    """

    num_steps: int = 0
    num_steps_ahead: int = 0  # scheduled while the step before ran (async scheduling)
    schedule_s: float = 0.0  # scheduling, admission of compiled grammars
    prepare_s: float = 0.0  # building the batch's input tensors
    forward_s: float = 0.0
    sample_s: float = 0.0  # logits processing and sampling
    output_s: float = 0.0  # appending tokens, stop checks, token deltas (text: front end)
    # Of the phases above, the time spent on the helper thread beside the forward pass
    # (async scheduling: the previous step's deltas, the next step's schedule and inputs).
    overlapped_s: float = 0.0

    def since(self, earlier: StepTimes) -> StepTimes:
        return StepTimes(
            *(getattr(self, f) - getattr(earlier, f) for f in self.__dataclass_fields__)
        )

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s + self.output_s
