"""Request-level latency and size distributions, as vLLM exports them.

Measured where a request's outputs reach the front end (`OutputProcessor`, on the thread
that receives the core's steps), so time to first token and inter-token latency include
everything but the HTTP hop: the queue, the forward passes, the IPC and the decoding of
text. The core adds what only it knows: how long a finished request waited, prefilled
and decoded (`RequestTimes`), how many of its prompt tokens the prefix cache held and how
often it was preempted (on its `RequestDelta`s). /metrics reads a `snapshot()` at scrape
time.

Names are vLLM's metric names without the `vllm:` prefix (api/metrics.py adds a prefix),
buckets are vLLM's, so dashboards and autoscaling rules written for vLLM read them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from serve.outputs import Histogram, RequestTimes
from serve.sequence import FinishReason

TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# 1, 2, 5, 10, 20, 50, ... tokens, past every context a model has today. vLLM's token
# histograms take this ladder up to max_model_len: /metrics shows those bounds of it,
# whose cumulative counts are the same whatever bounds follow.
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(10) for m in (1, 2, 5))
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
PREEMPTION_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)
# request_success's finished_reason labels, every one exported from the start (at 0, as
# vLLM does) so that ratios of their rates have data before the first of each.
FINISHED_REASONS = (*(reason.value for reason in FinishReason), "error")

# name → (buckets, help). The front end observes all of them; the queue time histogram
# is the scheduler's (by priority, outputs.QueueTimes).
HISTOGRAMS: dict[str, tuple[tuple[float, ...], str]] = {
    "time_to_first_token_seconds": (
        TTFT_BUCKETS_S,
        "Seconds from a request's arrival to its first output token.",
    ),
    "inter_token_latency_seconds": (
        ITL_BUCKETS_S,
        "Seconds between a request's successive outputs (one observation per step that "
        "gave it tokens).",
    ),
    "e2e_request_latency_seconds": (
        REQUEST_LATENCY_BUCKETS_S,
        "Seconds from a request's arrival to its last output, for finished requests.",
    ),
    "request_time_per_output_token_seconds": (
        ITL_BUCKETS_S,
        "Per request: seconds from its first to its last token over the tokens its "
        "longest sequence generated after its first (none for a request with no such "
        "tokens, nor for beam search, whose beams arrive whole).",
    ),
    "request_prefill_time_seconds": (
        REQUEST_LATENCY_BUCKETS_S,
        "Seconds from a request's first scheduled step to its first token, in the engine.",
    ),
    "request_decode_time_seconds": (
        REQUEST_LATENCY_BUCKETS_S,
        "Seconds from a request's first token to its end, in the engine.",
    ),
    "request_inference_time_seconds": (
        REQUEST_LATENCY_BUCKETS_S,
        "Seconds from a request's first scheduled step to its end (prefill and decode).",
    ),
    "request_prompt_tokens": (TOKEN_BUCKETS, "Prompt tokens per finished request."),
    "request_generation_tokens": (
        TOKEN_BUCKETS,
        "Generated tokens per finished request (all its sequences).",
    ),
    "request_max_num_generation_tokens": (
        TOKEN_BUCKETS,
        "Per finished request: the most tokens any one of its sequences generated.",
    ),
    "request_params_max_tokens": (TOKEN_BUCKETS, "The max_tokens of finished requests."),
    "request_params_n": (N_BUCKETS, "The n of finished requests."),
    "request_num_preemptions": (
        PREEMPTION_BUCKETS,
        "Per finished request: the times the engine preempted it.",
    ),
}
# The histograms of token counts, whose buckets /metrics cuts at max_model_len.
TOKEN_HISTOGRAMS = frozenset(name for name, (b, _) in HISTOGRAMS.items() if b is TOKEN_BUCKETS)


@dataclass
class FinishedRequest:
    """A request that ended by itself (a stop, a length), as the front end saw it."""

    reason: str  # its finished_reason label
    e2e_s: float
    # From its first to its last output tokens as the front end saw them; None when they
    # came all at once (beam search's results) or never (nothing sampled).
    decode_s: float | None
    num_prompt_tokens: int
    num_generated_tokens: int  # all its sequences'
    max_seq_tokens: int  # its longest sequence's: the tokens one choice decoded
    max_tokens: int | None
    n: int
    times: RequestTimes | None  # the core's phases
    num_preemptions: int = 0  # times the core preempted it
    # Sampled nothing (max_tokens 0: a pooling request, a prompt scored): it observes no
    # generation histogram, whose 0s would only drag their averages down.
    is_prefill_only: bool = False


@dataclass
class RequestMetricsSnapshot:
    histograms: dict[str, Histogram]
    prompt_tokens: int  # of requests that have had their first token (or finished without)
    prompt_tokens_cached: int  # of those, the tokens the prefix cache held
    generation_tokens: int  # output tokens that reached the front end
    finished: dict[str, int]  # requests by finish reason: stop, length, abort, error


class RequestMetrics:
    """The front end's request metrics. One writer thread (the output processor's);
    `snapshot` may run on any other."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._histograms = {name: Histogram(bounds) for name, (bounds, _) in HISTOGRAMS.items()}
        self._prompt_tokens = 0
        self._prompt_tokens_cached = 0
        self._generation_tokens = 0
        self._finished = dict.fromkeys(FINISHED_REASONS, 0)

    def first_token(self, ttft_s: float, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A request's first output tokens came: its prompt's tokens count, and those of
        them the prefix cache held."""
        with self._lock:
            self._histograms["time_to_first_token_seconds"].observe(ttft_s)
            self._prompt_tokens += num_prompt_tokens
            self._prompt_tokens_cached += num_cached_tokens

    def prompt_done(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A request that samples no token (max_tokens 0, an embedding) finished its
        prompt: its prompt tokens count, with no time to first token."""
        with self._lock:
            self._prompt_tokens += num_prompt_tokens
            self._prompt_tokens_cached += num_cached_tokens

    def new_tokens(self, num_tokens: int, since_last_s: float | None) -> None:
        """A step gave a request `num_tokens`; `since_last_s` since its previous output
        (None for its first)."""
        with self._lock:
            self._generation_tokens += num_tokens
            if since_last_s is not None:
                self._histograms["inter_token_latency_seconds"].observe(since_last_s)

    def finished(self, r: FinishedRequest) -> None:
        """A request ended by itself: counted by reason, and its histograms observed."""
        h = self._histograms
        with self._lock:
            self._finished[r.reason] = self._finished.get(r.reason, 0) + 1
            h["e2e_request_latency_seconds"].observe(r.e2e_s)
            h["request_prompt_tokens"].observe(r.num_prompt_tokens)
            h["request_params_n"].observe(r.n)
            h["request_num_preemptions"].observe(r.num_preemptions)
            if r.times is not None:
                h["request_prefill_time_seconds"].observe(r.times.prefill_s)
                h["request_inference_time_seconds"].observe(r.times.prefill_s + r.times.decode_s)
            if r.is_prefill_only:
                return
            h["request_generation_tokens"].observe(r.num_generated_tokens)
            h["request_max_num_generation_tokens"].observe(r.max_seq_tokens)
            if r.max_tokens is not None:
                h["request_params_max_tokens"].observe(r.max_tokens)
            if r.times is not None:
                h["request_decode_time_seconds"].observe(r.times.decode_s)
            # Per sequence, as vLLM's n child requests each time their own tokens: the n
            # sequences decode side by side, so dividing by all their tokens reads 1/n.
            if r.decode_s is not None and r.max_seq_tokens > 1:
                per_token = r.decode_s / (r.max_seq_tokens - 1)
                h["request_time_per_output_token_seconds"].observe(per_token)

    def ended_early(self, reason: str) -> None:
        """A request ended before it finished: "abort" (its client left, it timed out) or
        "error" (processing it failed). Counted, not timed."""
        with self._lock:
            self._finished[reason] = self._finished.get(reason, 0) + 1

    def snapshot(self) -> RequestMetricsSnapshot:
        with self._lock:
            return RequestMetricsSnapshot(
                {name: h.copy() for name, h in self._histograms.items()},
                self._prompt_tokens,
                self._prompt_tokens_cached,
                self._generation_tokens,
                dict(self._finished),
            )
