"""/metrics in Prometheus' text format: request latencies, the engine's state and
counters, and HTTP answers.

Two kinds of series:
- vLLM's: the request-level histograms (time to first token, inter-token and end-to-end
  latency, queue, prefill and decode time, tokens and preemptions per request), the token
  (cached prompt tokens too) and finished request counters, tokens per engine step, the
  scheduler's queue lengths (waiting by reason too), KV cache use, prefix cache hits,
  preemptions, and the cache's settings (`cache_config_info`, a gauge at 1). Their names,
  meanings and buckets are vLLM's (the token counts' sized by max_model_len), and they
  carry its `model_name` and `engine` ("0": serve runs one engine core) labels, which
  vLLM's dashboards filter and group by; the prefix is `serve_` by default (Prometheus
  reserves `:` for recording rules) and `vllm:` with `--metrics-names vllm`, under which
  vLLM's dashboards and autoscaling rules work unchanged (the older names its example
  dashboard still reads come too).
- serve's own, always `serve_`: engine liveness, KV blocks, step phases, HTTP statuses.

The request metrics are the front end's (engine/request_metrics.py), read at scrape time;
the engine's figures come from the latest `CoreStats` the core sent (at most every 0.5 s
while busy, and when it goes idle). A scrape never waits on the engine. Each app has its
own registry, so several servers in one process (tests) do not share counters.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from serve.config import CacheConfig, LoRAConfig
from serve.engine.protocol import EngineClient
from serve.engine.request_metrics import HISTOGRAMS, TOKEN_HISTOGRAMS
from serve.outputs import (
    QUEUE_TIME_BUCKETS_S,
    EngineStats,
    Histogram,
    QueueTimes,
    SpecDecodeStats,
)

METRIC_PREFIXES = {"serve": "serve_", "vllm": "vllm:"}  # --metrics-names
# vLLM's older names, which its example Grafana dashboard still reads: alias → name.
VLLM_ALIASES = {
    "time_per_output_token_seconds": "inter_token_latency_seconds",
    "gpu_cache_usage_perc": "kv_cache_usage_perc",
}
_STEP_PHASES = ("schedule", "prepare", "forward", "sample", "output")
DEFAULT_PRIORITY_LABEL = "0"  # the queue time's priority label of a request that gives none
ENGINE_LABEL = "0"  # vLLM's engine index: serve runs one engine core


class _EngineCollector(Collector):
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        names: str,
        cache: CacheConfig,
        lora: LoRAConfig,
    ) -> None:
        self.engine = engine
        self.lora = lora
        self.labels = ["model_name", "engine"]  # on every vLLM-shaped series, as vLLM's
        self.label_values = [model_name, ENGINE_LABEL]
        self.cache = cache
        self.prefix = METRIC_PREFIXES[names]
        self.aliases = names == "vllm"

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "serve_engine_alive",
            "1 while the engine runs, 0 once it has died.",
            value=1 if self.engine.is_alive else 0,
        )
        yield from self._request_metrics()
        stats = self.engine.core_stats
        if stats is None:
            return
        yield from self._engine_metrics()
        e = stats.engine
        yield self._cache_config_info(e.num_blocks_total, e.num_cpu_blocks_total)
        for name, doc, value in (
            ("serve_kv_cache_blocks_total", "KV cache blocks on the device.", e.num_blocks_total),
            ("serve_kv_cache_blocks_used", "KV blocks held by sequences.", e.num_blocks_used),
            (
                "serve_kv_cache_blocks_cached",
                "Free KV blocks still holding a reusable prefix.",
                e.num_blocks_cached,
            ),
            ("serve_cpu_swap_blocks_used", "Swap-space blocks in use.", e.num_cpu_blocks_used),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("serve_engine_steps", "Engine steps run.", stats.step_times.num_steps),
            (
                "serve_engine_overlapped_seconds",
                "Of serve_engine_step_seconds, the seconds spent beside the forward pass "
                "(async scheduling).",
                stats.step_times.overlapped_s,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        if e.sjf_predictor_mae_tokens is not None:
            yield GaugeMetricFamily(
                "serve_sjf_predictor_mae_tokens",
                "sjf: mean absolute error, in tokens, of the output lengths predicted for "
                "the last 256 requests when they were admitted.",
                value=e.sjf_predictor_mae_tokens,
            )
        if e.sjf_longest_passed_over_s is not None:
            yield GaugeMetricFamily(
                "serve_sjf_longest_passed_over_seconds",
                "sjf: the longest any request has waited while requests that arrived after "
                "it ran, since start (--sjf-max-wait-s bounds it).",
                value=e.sjf_longest_passed_over_s,
            )
        phases = CounterMetricFamily(
            "serve_engine_step_seconds",
            "Seconds spent in each phase of the engine's steps.",
            labels=["phase"],
        )
        for phase in _STEP_PHASES:
            phases.add_metric([phase], getattr(stats.step_times, f"{phase}_s"))
        yield phases

    # -- vLLM's series -------------------------------------------------------------------

    def _names(self, name: str) -> list[str]:
        """The metric's exported names: vLLM's, prefixed, and its older alias if any."""
        names = [self.prefix + name]
        if self.aliases:
            names += [self.prefix + old for old, new in VLLM_ALIASES.items() if new == name]
        return names

    def _request_metrics(self) -> Iterator[Metric]:
        snap = self.engine.request_metrics.snapshot()
        max_model_len = self.engine.max_model_len
        for name, (_, doc) in HISTOGRAMS.items():
            # vLLM's token buckets: 1, 2, 5, 10, ... up to max_model_len.
            up_to = max_model_len if name in TOKEN_HISTOGRAMS else float("inf")
            for exported in self._names(name):
                yield self._histogram(exported, doc, snap.histograms[name], up_to)
        for name, doc, value in (
            ("prompt_tokens", "Prompt tokens of requests that have started.", snap.prompt_tokens),
            (
                "prompt_tokens_cached",
                "Of prompt_tokens, those whose K/V the prefix cache held when their request "
                "was first scheduled.",
                snap.prompt_tokens_cached,
            ),
            ("generation_tokens", "Generated tokens (all sequences).", snap.generation_tokens),
        ):
            yield self._counter(self.prefix + name, doc, value)
        finished = CounterMetricFamily(
            self.prefix + "request_success",
            "Requests that ended, by finish reason (stop, length, abort, error).",
            labels=[*self.labels, "finished_reason"],
        )
        for reason, count in sorted(snap.finished.items()):
            finished.add_metric([*self.label_values, reason], count)
        yield finished

    def _engine_metrics(self) -> Iterator[Metric]:
        stats = self.engine.core_stats
        assert stats is not None
        e = stats.engine
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", e.num_running),
            ("num_requests_waiting", "Requests waiting to start.", e.num_waiting),
            ("num_requests_swapped", "Requests swapped out to CPU.", e.num_swapped),
            (
                "kv_cache_usage_perc",
                "Fraction (0 to 1) of the KV cache's blocks held by sequences.",
                e.num_blocks_used / max(e.num_blocks_total, 1),
            ),
            (
                "cpu_cache_usage_perc",
                "Fraction (0 to 1) of the swap space's blocks in use.",
                e.num_cpu_blocks_used / max(e.num_cpu_blocks_total, 1),
            ),
        ):
            for exported in self._names(name):
                yield self._gauge(exported, doc, value)
        waiting = GaugeMetricFamily(
            self.prefix + "num_requests_waiting_by_reason",
            "Waiting requests by reason: capacity (for seats, blocks or tokens in a step), "
            "deferred (for their grammar to compile). They add up to num_requests_waiting.",
            labels=[*self.labels, "reason"],
        )
        num_deferred = e.num_waiting_for_grammar
        waiting.add_metric([*self.label_values, "capacity"], e.num_waiting - num_deferred)
        waiting.add_metric([*self.label_values, "deferred"], num_deferred)
        yield waiting
        for name, doc, value in (
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                e.prefix_cache_queries,
            ),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", e.prefix_cache_hits),
            ("num_preemptions", "Requests preempted for lack of KV blocks.", e.num_preemptions),
        ):
            yield self._counter(self.prefix + name, doc, value)
        yield self._queue_time_histogram(e.queue_times)
        yield self._histogram(
            self.prefix + "iteration_tokens_total",
            "Tokens per engine step: the prompt chunks, decode tokens and proposals it ran "
            "through the model.",
            e.iteration_tokens,
        )
        if e.spec_decode is not None:
            yield from self._spec_decode_metrics(e.spec_decode)
        if self.lora.enable_lora:
            yield self._lora_info(e)

    def _lora_info(self, e: EngineStats) -> Metric:
        """vLLM's lora_requests_info: one series whose labels name the adapters of the
        running and the waiting requests (comma-separated) and --max-loras, its value the
        time of the engine's report. (vLLM's gauge keeps every label set it ever had;
        this one says only the latest.)"""
        gauge = GaugeMetricFamily(
            self.prefix + "lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        waiting, running = ",".join(e.waiting_lora_adapters), ",".join(e.running_lora_adapters)
        gauge.add_metric([str(self.lora.max_loras), waiting, running], time.time())
        return gauge

    def _cache_config_info(self, num_gpu_blocks: int, num_cpu_blocks: int) -> Metric:
        """vLLM's info series: a gauge at 1 whose labels are the KV cache's settings (as
        Python writes them: "True", "None"), with the block counts the engine found at
        start (`num_gpu_blocks` on any device, `num_cpu_blocks` the swap space's), one
        engine ("0"). No model_name label, as vLLM's has none."""
        c = self.cache
        labels = {
            "block_size": c.block_size,
            "cache_dtype": c.kv_cache_dtype,
            "enable_prefix_caching": c.enable_prefix_caching,
            "gpu_memory_utilization": c.gpu_memory_utilization,
            "kv_cache_memory_bytes": c.kv_cache_memory_bytes,
            "num_cpu_blocks": num_cpu_blocks,
            "num_gpu_blocks": num_gpu_blocks,
            "num_gpu_blocks_override": c.num_gpu_blocks_override,
            "swap_space": c.swap_space,
            "engine": 0,
        }
        gauge = GaugeMetricFamily(
            self.prefix + "cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(labels),
        )
        gauge.add_metric([str(value) for value in labels.values()], 1)
        return gauge

    def _spec_decode_metrics(self, spec: SpecDecodeStats) -> Iterator[Metric]:
        """vLLM's speculative decoding counters; the acceptance rate is accepted over draft
        tokens, the mean accepted length 1 + accepted over drafts (as rates of these)."""
        for name, doc, value in (
            ("spec_decode_num_drafts", "Sequence steps that checked proposals.", spec.num_drafts),
            ("spec_decode_num_draft_tokens", "Proposed tokens checked.", spec.num_draft_tokens),
            (
                "spec_decode_num_accepted_tokens",
                "Proposed tokens accepted.",
                spec.num_accepted_tokens,
            ),
        ):
            yield self._counter(self.prefix + name, doc, value)
        per_position = CounterMetricFamily(
            self.prefix + "spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose proposal at this position (0-based) was accepted.",
            labels=[*self.labels, "position"],
        )
        for position, count in enumerate(spec.accepted_per_position):
            per_position.add_metric([*self.label_values, str(position)], count)
        yield per_position
        for name, doc, value in (
            (
                "spec_decode_acceptance_rate",
                "Accepted over proposed tokens since start.",
                spec.acceptance_rate,
            ),
            (
                "spec_decode_mean_accepted_length",
                "Tokens a checking step gives a sequence on average since start (1 + accepted).",
                spec.mean_accepted_length,
            ),
        ):
            yield self._gauge(self.prefix + name, doc, value)

    def _queue_time_histogram(self, queue_times: QueueTimes) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            self.prefix + "request_queue_time_seconds",
            "Seconds from a request's arrival at the engine to its first scheduled step, "
            "by priority (0 unless --scheduling-policy priority).",
            labels=[*self.labels, "priority"],
        )
        bounds = [floatToGoString(b) for b in QUEUE_TIME_BUCKETS_S] + ["+Inf"]
        # The default priority's series is there from the start, at 0, as vLLM's is.
        counts_by_label = {DEFAULT_PRIORITY_LABEL: [0] * len(bounds), **queue_times.counts}
        for label, counts in sorted(counts_by_label.items()):
            buckets = list(zip(bounds, counts))
            total = queue_times.sums.get(label, 0.0)
            family.add_metric([*self.label_values, label], buckets, total)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=self.labels)
        family.add_metric(self.label_values, value)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=self.labels)
        family.add_metric(self.label_values, value)
        return family

    def _histogram(
        self, name: str, doc: str, h: Histogram, up_to: float = float("inf")
    ) -> HistogramMetricFamily:
        """`h` with its bounds up to `up_to`, written as prometheus_client writes its
        own (1e+06, not 1000000.0), as vLLM's are."""
        family = HistogramMetricFamily(name, doc, labels=self.labels)
        buckets = [(floatToGoString(le), n) for le, n in h.cumulative(up_to)]
        family.add_metric(self.label_values, buckets, h.total)
        return family


class ServerMetrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        names: str = "serve",
        cache: CacheConfig | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        if names not in METRIC_PREFIXES:
            raise ValueError(f"metrics names must be one of {sorted(METRIC_PREFIXES)}")
        self.registry = CollectorRegistry()
        collector = _EngineCollector(
            engine, model_name, names, cache or CacheConfig(), lora or LoRAConfig()
        )
        self.registry.register(collector)
        # The front end's process_* (memory, CPU, open files) and python_* series, as
        # vLLM's server exports them for dashboards and alerts (the engine core is a
        # process of its own: its memory is not in these).
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
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
