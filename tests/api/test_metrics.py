"""/metrics: the engine's state and counters and the HTTP answers, in Prometheus' format."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import pytest
from api.conftest import metric_samples, scrape_metrics, wait_until_idle
from prometheus_client.parser import text_string_to_metric_families

from serve.api.metrics import ServerMetrics
from serve.engine.messages import CoreStats
from serve.engine.request_metrics import HISTOGRAMS, FinishedRequest, RequestMetrics
from serve.outputs import EngineStats, SpecDecodeStats, StepTimes


def test_metrics_count_tokens_and_responses_and_free_blocks(server):
    before = wait_until_idle(server)
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 7, "ignore_eos": True}
    for _ in range(2):
        assert httpx.post(f"{server.v1}/completions", json=body, timeout=30).status_code == 200
    assert httpx.post(f"{server.v1}/completions", json={"prompt": 5}).status_code == 400

    after = wait_until_idle(server)
    generated = after["serve_generation_tokens_total"] - before["serve_generation_tokens_total"]
    assert generated == 14
    assert after["serve_engine_steps_total"] > before["serve_engine_steps_total"]
    assert after['serve_engine_step_seconds_total{phase="forward"}'] > 0
    ok = 'serve_http_responses_total{status="200"}'
    bad = 'serve_http_responses_total{status="400"}'
    assert after[ok] - before.get(ok, 0) >= 2
    assert after[bad] - before.get(bad, 0) == 1
    assert after["serve_engine_alive"] == 1
    assert after["serve_kv_cache_blocks_used"] == 0
    assert after["serve_kv_cache_blocks_total"] > 0
    assert 0 <= after["serve_kv_cache_usage_perc"] <= 1


def test_metrics_show_a_running_request(long_context_model, server_factory):
    server = server_factory("--max-model-len", "4096", model=long_context_model)
    body = {
        "model": server.model,
        "prompt": "Once upon a time",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(20):
            next(lines)
        busy = scrape_metrics(server)
    assert busy["serve_num_requests_running"] == 1
    assert busy["serve_kv_cache_blocks_used"] >= 1
    idle = wait_until_idle(server)
    assert idle["serve_kv_cache_blocks_used"] == 0


def test_every_finished_reason_and_the_default_priority_are_there_from_the_start():
    """Before any request, as in vLLM: request_success at 0 for each finished reason and
    the queue time of the default priority at 0, so that a ratio of their rates (an
    alert's error rate) has data instead of no series."""
    text = ServerMetrics(_engine(), "m").render().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    for reason in ("stop", "length", "abort", "error"):
        labels = (("engine", "0"), ("finished_reason", reason), ("model_name", "m"))
        assert samples[("serve_request_success_total", labels)] == 0, reason
    queue = (("engine", "0"), ("model_name", "m"), ("priority", "0"))
    assert samples[("serve_request_queue_time_seconds_count", queue)] == 0
    assert samples[("serve_request_queue_time_seconds_sum", queue)] == 0


def _engine(
    max_model_len: int = 4096,
    request_metrics: RequestMetrics | None = None,
    stats: EngineStats | None = None,
) -> SimpleNamespace:
    """Just enough of an EngineClient for /metrics."""
    return SimpleNamespace(
        is_alive=True,
        max_model_len=max_model_len,
        request_metrics=request_metrics or RequestMetrics(),
        core_stats=CoreStats(stats or EngineStats(64, 0, 0, 0, 0, 0, 0, 0.0), 0, StepTimes()),
    )


def _one_two_five(max_value: int) -> list[float]:
    """vLLM's token buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    bounds, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return bounds
            bounds.append(float(m * scale))
        scale *= 10


TOKEN_HISTOGRAMS = (
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_params_max_tokens",
    "request_max_num_generation_tokens",
)


@pytest.mark.parametrize("names", ["serve", "vllm"])
@pytest.mark.parametrize("max_model_len", [4096, 2_000_000])
def test_every_histograms_buckets_strictly_increase(names, max_model_len):
    """Each series' `le` values rise strictly to +Inf, once each; the token counts' are
    vLLM's, 1, 2, 5, 10, ... up to max_model_len."""
    metrics = RequestMetrics()
    metrics.first_token(0.2, 3000, 0)
    metrics.new_tokens(1, None)
    finished = FinishedRequest("length", 1.0, 0.5, 3000, 1, 1, 1, 1, None, num_preemptions=2)
    metrics.finished(finished)
    stats = EngineStats(64, 0, 0, 0, 0, 0, 0, 0.0, spec_decode=SpecDecodeStats())
    stats.queue_times.observe(3, 0.2)
    stats.iteration_tokens.observe(3000)
    text = ServerMetrics(_engine(max_model_len, metrics, stats), "m", names).render().decode()
    prefix = "vllm:" if names == "vllm" else "serve_"
    buckets: dict[tuple, list[str]] = {}  # (family, its labels but le) -> le values in order
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.type == "histogram" and sample.name.endswith("_bucket"):
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
                buckets.setdefault((family.name, labels), []).append(sample.labels["le"])
    # Each of the request metrics, the queue time's two priorities, the tokens per step.
    assert len(buckets) >= len(HISTOGRAMS) + 3
    for (name, _), les in buckets.items():
        bounds = [float(le) for le in les]
        assert les[-1] == "+Inf", name
        assert all(a < b for a, b in zip(bounds, bounds[1:])), f"{name}: {les}"
    for name in TOKEN_HISTOGRAMS:
        (les,) = [les for (n, _), les in buckets.items() if n == prefix + name]
        assert [float(le) for le in les[:-1]] == _one_two_five(max_model_len), name
    samples = metric_samples(text)
    # 3000 prompt tokens: above every bound up to 4096 (2000), at most the next (5000).
    le_5000 = samples.get(f'{prefix}request_prompt_tokens_bucket{{le="5000.0"}}')
    assert le_5000 == (None if max_model_len == 4096 else 1)
    assert samples[f'{prefix}request_prompt_tokens_bucket{{le="2000.0"}}'] == 0
    assert samples[f'{prefix}request_prompt_tokens_bucket{{le="+Inf"}}'] == 1


# The series vLLM 0.32's Prometheus logger labels with model_name and engine
# (vllm/v1/metrics/loggers.py, spec_decode/metrics.py), that serve has.
VLLM_ENGINE_SERIES = (
    "num_requests_running",
    "num_requests_waiting",
    "num_requests_waiting_by_reason",
    "kv_cache_usage_perc",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "prompt_tokens",
    "prompt_tokens_cached",
    "generation_tokens",
    "request_success",
    "iteration_tokens_total",
    "request_queue_time_seconds",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
    *HISTOGRAMS,  # the request histograms
)


def test_the_front_ends_process_and_python_series_are_there():
    """process_* and python_* come with vLLM's server; dashboards and alerts read them
    (the resident memory, the CPU seconds), and serve's /metrics had none."""
    samples = metric_samples(ServerMetrics(_engine(), "m").render().decode())
    assert samples["process_resident_memory_bytes"] > 0
    assert samples["process_cpu_seconds_total"] > 0
    assert any(name.startswith("python_info{") for name in samples)
    assert any(name.startswith("python_gc_collections_total{") for name in samples)


def test_vllm_series_carry_the_engine_label_as_vllms_do():
    """vLLM's dashboards filter and group by `engine`: every series of model_name has it
    ("0": one engine core), as in vLLM."""
    stats = EngineStats(64, 0, 0, 0, 0, 0, 0, 0.0, spec_decode=SpecDecodeStats(1, 2, 1, [1, 0]))
    text = ServerMetrics(_engine(stats=stats), "m", "vllm").render().decode()
    labelled: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "model_name" in sample.labels:
                labelled.setdefault(family.name, []).append(sample.labels)
    missing = [name for name in VLLM_ENGINE_SERIES if f"vllm:{name}" not in labelled]
    assert not missing
    for name, labels in labelled.items():
        assert all(ls["engine"] == "0" and ls["model_name"] == "m" for ls in labels), name


def test_cached_prompt_tokens_preemptions_step_tokens_and_waiting_reasons():
    metrics = RequestMetrics()
    metrics.first_token(0.1, 40, 32)
    metrics.prompt_done(10, 8)  # an embedding's prompt
    for num_preemptions in (0, 3):
        r = FinishedRequest("stop", 1.0, None, 40, 2, 2, 2, 1, None, num_preemptions)
        metrics.finished(r)
    stats = EngineStats(64, 0, 0, 0, 0, 0, 0, 0.0, num_waiting=5, num_waiting_for_grammar=2)
    for tokens in (1, 40, 300):
        stats.iteration_tokens.observe(tokens)
    text = ServerMetrics(_engine(4096, metrics, stats), "m").render().decode()
    samples = metric_samples(text)
    assert samples["serve_prompt_tokens_total"] == 50
    assert samples["serve_prompt_tokens_cached_total"] == 40
    assert samples["serve_request_num_preemptions_count"] == 2
    assert samples["serve_request_num_preemptions_sum"] == 3
    assert samples['serve_request_num_preemptions_bucket{le="1.0"}'] == 1
    assert samples["serve_iteration_tokens_total_count"] == 3
    assert samples["serve_iteration_tokens_total_sum"] == 341
    assert samples['serve_iteration_tokens_total_bucket{le="64.0"}'] == 2
    waiting = 'serve_num_requests_waiting_by_reason{reason="%s"}'
    assert (samples[waiting % "capacity"], samples[waiting % "deferred"]) == (3, 2)
    assert samples["serve_num_requests_waiting"] == 5


def test_lora_requests_info_names_the_running_and_waiting_adapters():
    """vLLM's lora_requests_info, with --enable-lora: --max-loras and the adapters of the
    running and waiting requests as labels, its value the time of the report; none
    without LoRA."""
    from serve.config import LoRAConfig

    stats = EngineStats(64, 0, 0, 0, 0, 0, 0, 0.0)
    stats.running_lora_adapters = {"sql": 2, "chat": 1}
    stats.waiting_lora_adapters = {"poems": 3}
    before = time.time()
    lora = LoRAConfig(enable_lora=True, max_loras=2)
    text = ServerMetrics(_engine(stats=stats), "m", "vllm", lora=lora).render().decode()
    (sample,) = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:lora_requests_info"
    ]
    assert sample.labels == {
        "max_lora": "2",
        "running_lora_adapters": "sql,chat",
        "waiting_lora_adapters": "poems",
    }
    assert before <= sample.value <= time.time()
    plain = ServerMetrics(_engine(stats=stats), "m", "vllm").render().decode()
    assert "lora_requests_info" not in plain
