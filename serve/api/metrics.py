"""/metrics in Prometheus' text format: the engine's state and counters, and HTTP answers.

The engine's figures come from the latest `CoreStats` the core sent (at most every
0.5 s while busy, and when it goes idle), read at scrape time by a collector: a scrape
never waits on the engine. Each app has its own registry, so several servers in one
process (tests) do not share counters.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from serve.engine.protocol import EngineClient
from serve.outputs import QUEUE_TIME_BUCKETS_S, QueueTimes

_STEP_PHASES = ("schedule", "prepare", "forward", "sample", "output")


class _EngineCollector(Collector):
    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "serve_engine_alive",
            "1 while the engine runs, 0 once it has died.",
            value=1 if self.engine.is_alive else 0,
        )
        stats = self.engine.core_stats
        if stats is None:
            return
        e = stats.engine
        for name, doc, value in (
            ("serve_num_requests_running", "Requests in the running batch.", e.num_running),
            ("serve_num_requests_waiting", "Requests waiting to start.", e.num_waiting),
            ("serve_num_requests_swapped", "Requests swapped out to CPU.", e.num_swapped),
            ("serve_kv_cache_blocks_total", "KV cache blocks on the device.", e.num_blocks_total),
            ("serve_kv_cache_blocks_used", "KV blocks held by sequences.", e.num_blocks_used),
            (
                "serve_kv_cache_blocks_cached",
                "Free KV blocks still holding a reusable prefix.",
                e.num_blocks_cached,
            ),
            (
                "serve_kv_cache_usage_ratio",
                "Fraction of the KV cache's blocks held by sequences.",
                e.num_blocks_used / max(e.num_blocks_total, 1),
            ),
            ("serve_cpu_swap_blocks_used", "Swap-space blocks in use.", e.num_cpu_blocks_used),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            (
                "serve_generation_tokens",
                "Tokens sampled (beams included).",
                stats.num_generated_tokens,
            ),
            (
                "serve_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                e.prefix_cache_queries,
            ),
            (
                "serve_prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                e.prefix_cache_hits,
            ),
            (
                "serve_num_preemptions",
                "Requests preempted for lack of KV blocks.",
                e.num_preemptions,
            ),
            ("serve_engine_steps", "Engine steps run.", stats.step_times.num_steps),
            (
                "serve_engine_overlapped_seconds",
                "Of serve_engine_step_seconds, the seconds spent beside the forward pass "
                "(async scheduling).",
                stats.step_times.overlapped_s,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield _queue_time_histogram(e.queue_times)
        if e.sjf_predictor_mae_tokens is not None:
            yield GaugeMetricFamily(
                "serve_sjf_predictor_mae_tokens",
                "sjf: mean absolute error, in tokens, of the output lengths predicted for "
                "the last 256 requests when they were admitted.",
                value=e.sjf_predictor_mae_tokens,
            )
        phases = CounterMetricFamily(
            "serve_engine_step_seconds",
            "Seconds spent in each phase of the engine's steps.",
            labels=["phase"],
        )
        for phase in _STEP_PHASES:
            phases.add_metric([phase], getattr(stats.step_times, f"{phase}_s"))
        yield phases


def _queue_time_histogram(queue_times: QueueTimes) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "serve_request_queue_time_seconds",
        "Seconds from a request's arrival at the engine to its first scheduled step, by "
        "priority (0 unless --scheduling-policy priority).",
        labels=["priority"],
    )
    for label, counts in sorted(queue_times.counts.items()):
        bounds = [str(b) for b in QUEUE_TIME_BUCKETS_S] + ["+Inf"]
        family.add_metric([label], list(zip(bounds, counts)), queue_times.sums[label])
    return family


class ServerMetrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.http_responses = Counter(
            "serve_http_responses",
            "HTTP responses by status code (499: the client hung up first).",
            ["status"],
            registry=self.registry,
        )

    def count_response(self, status: int) -> None:
        self.http_responses.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
