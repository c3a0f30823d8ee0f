"""/metrics: the engine's state and counters and the HTTP answers, in Prometheus' format."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
from api.conftest import scrape_metrics, wait_until_idle
from prometheus_client.parser import text_string_to_metric_families

from serve.api.metrics import ServerMetrics
from serve.engine.messages import CoreStats
from serve.engine.request_metrics import RequestMetrics
from serve.outputs import EngineStats, StepTimes


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
    engine = SimpleNamespace(
        is_alive=True,
        request_metrics=RequestMetrics(),
        core_stats=CoreStats(EngineStats(64, 0, 0, 0, 0, 0, 0, 0.0), 0, StepTimes()),
    )
    text = ServerMetrics(engine, "m").render().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    for reason in ("stop", "length", "abort", "error"):
        labels = (("finished_reason", reason), ("model_name", "m"))
        assert samples[("serve_request_success_total", labels)] == 0, reason
    queue = (("model_name", "m"), ("priority", "0"))
    assert samples[("serve_request_queue_time_seconds_count", queue)] == 0
    assert samples[("serve_request_queue_time_seconds_sum", queue)] == 0
