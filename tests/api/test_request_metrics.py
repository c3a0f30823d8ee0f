"""Request-level histograms on /metrics agree with what a client measures, and with
vLLM's names under --metrics-names vllm."""

from __future__ import annotations

import time

import httpx
import pytest
from api.conftest import wait_until_idle

NUM_REQUESTS = 3
MAX_TOKENS = 8
# What the server's clock leaves out of the client's: the HTTP hop and the request's
# parsing and tokenization before it reaches the engine, per request.
HTTP_SLACK_S = 0.5


def _stream(server, body: dict) -> tuple[float, float, int]:
    """Client-side TTFT and E2E of one streamed completion, and its text chunks."""
    start = time.perf_counter()
    ttft = None
    chunks = 0
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            chunks += 1
    assert ttft is not None
    return ttft, time.perf_counter() - start, chunks


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_latency_histograms_agree_with_the_client(server):
    before = wait_until_idle(server)
    body = {
        "model": server.model,
        "prompt": "Hello there",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    measured = [_stream(server, body) for _ in range(NUM_REQUESTS)]
    after = wait_until_idle(server)

    def d(key: str) -> float:
        return _delta(after, before, key)

    assert d("serve_time_to_first_token_seconds_count") == NUM_REQUESTS
    assert d("serve_e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert d('serve_request_success_total{finished_reason="length"}') == NUM_REQUESTS
    assert d("serve_generation_tokens_total") == NUM_REQUESTS * MAX_TOKENS
    assert d("serve_request_generation_tokens_sum") == NUM_REQUESTS * MAX_TOKENS
    assert d("serve_request_params_max_tokens_sum") == NUM_REQUESTS * MAX_TOKENS
    # One inter-token observation per step after the first token: one token per step.
    assert d("serve_inter_token_latency_seconds_count") == NUM_REQUESTS * (MAX_TOKENS - 1)

    # The server's clocks start after the client's and stop before it reads the answer,
    # by no more than the HTTP hop.
    client_ttft = sum(t for t, _, _ in measured)
    client_e2e = sum(e for _, e, _ in measured)
    server_ttft = d("serve_time_to_first_token_seconds_sum")
    server_e2e = d("serve_e2e_request_latency_seconds_sum")
    assert 0 < server_ttft <= client_ttft <= server_ttft + NUM_REQUESTS * HTTP_SLACK_S
    assert 0 < server_e2e <= client_e2e <= server_e2e + NUM_REQUESTS * HTTP_SLACK_S
    # A request's inter-token gaps add up to its time from first to last token.
    server_itl = d("serve_inter_token_latency_seconds_sum")
    assert server_ttft + server_itl == pytest.approx(server_e2e, abs=1e-6)

    # The engine's phases fit inside the front end's view of the same requests.
    prefill = d("serve_request_prefill_time_seconds_sum")
    decode = d("serve_request_decode_time_seconds_sum")
    assert d("serve_request_decode_time_seconds_count") == NUM_REQUESTS
    assert prefill > 0 and decode > 0
    assert d("serve_request_inference_time_seconds_sum") == pytest.approx(prefill + decode)
    assert prefill + decode <= server_e2e

    # Every observation sits in a bucket: the +Inf bucket counts them all.
    ttft_inf = d('serve_time_to_first_token_seconds_bucket{le="+Inf"}')
    assert ttft_inf == NUM_REQUESTS


def _complete(server, **body) -> dict:
    body = {"model": server.model, "prompt": "Hello", "ignore_eos": True, **body}
    resp = httpx.post(f"{server.v1}/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_time_per_output_token_is_per_choice_for_n_choices(server):
    """n choices decode side by side: a request's time per output token is its time from
    first to last token over what one choice decoded after its first, not over all
    choices' tokens (vLLM times each of its n child requests on its own)."""
    before = wait_until_idle(server)
    n, max_tokens = 2, 40
    usage = _complete(server, n=n, max_tokens=max_tokens)["usage"]
    assert usage["completion_tokens"] == n * max_tokens
    after = wait_until_idle(server)

    def d(key: str) -> float:
        return _delta(after, before, f"serve_{key}")

    assert d("request_time_per_output_token_seconds_count") == 1
    # The front end's first-to-last token time is its end-to-end latency less its TTFT.
    decode_s = d("e2e_request_latency_seconds_sum") - d("time_to_first_token_seconds_sum")
    tpot = d("request_time_per_output_token_seconds_sum")
    assert decode_s > 0
    assert tpot == pytest.approx(decode_s / (max_tokens - 1), rel=1e-6)
    # The token counts stay every choice's.
    assert d("generation_tokens_total") == n * max_tokens
    assert d("request_generation_tokens_sum") == n * max_tokens
    assert d("request_max_num_generation_tokens_sum") == max_tokens


@pytest.mark.parametrize(
    "body",
    [
        {"n": 2, "max_tokens": 1},
        {"n": 2, "best_of": 2, "max_tokens": 6, "use_beam_search": True, "temperature": 0},
    ],
    ids=["one-token-choices", "beam-search"],
)
def test_no_time_per_output_token_without_a_decode_to_time(server, body):
    """One token per choice has no time between tokens; beam search's beams reach the
    front end whole, at the end (vLLM runs it as one-token requests). Neither adds a
    0 s time per output token, but both are finished requests with their tokens."""
    before = wait_until_idle(server)
    _complete(server, **body)
    after = wait_until_idle(server)
    assert _delta(after, before, "serve_request_time_per_output_token_seconds_count") == 0
    assert _delta(after, before, "serve_e2e_request_latency_seconds_count") == 1
    tokens = body["n"] * body["max_tokens"]
    assert _delta(after, before, "serve_request_generation_tokens_sum") == tokens


GENERATION_HISTOGRAMS = (
    "request_generation_tokens",
    "request_max_num_generation_tokens",
    "request_params_max_tokens",
    "request_decode_time_seconds",
    "request_time_per_output_token_seconds",
)


def test_embeddings_observe_no_generation_histograms(server):
    """An embedding samples nothing: it is a finished request with its prompt, but adds
    no 0 to the histograms of what requests generate."""
    before = wait_until_idle(server)
    texts = ["The sea is wide.", "A cat sat on the mat."]
    resp = httpx.post(
        f"{server.v1}/embeddings", json={"model": server.model, "input": texts}, timeout=60
    )
    assert resp.status_code == 200, resp.text
    after = wait_until_idle(server)

    def d(key: str) -> float:
        return _delta(after, before, f"serve_{key}")

    for name in GENERATION_HISTOGRAMS:
        assert d(f"{name}_count") == 0, name
    assert d('request_success_total{finished_reason="stop"}') == len(texts)
    assert d("e2e_request_latency_seconds_count") == len(texts)
    assert d("request_prompt_tokens_count") == len(texts)
    assert d("request_prompt_tokens_sum") == resp.json()["usage"]["prompt_tokens"]
    assert d("prompt_tokens_total") == resp.json()["usage"]["prompt_tokens"]


def test_a_client_that_leaves_counts_as_an_abort(long_context_model, server_factory):
    # The same server as test_metrics.py's running request (one start for both).
    server = server_factory("--max-model-len", "4096", model=long_context_model)
    before = wait_until_idle(server)
    body = {
        "model": server.model,
        "prompt": "Tell me a story",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(lines)
    after = wait_until_idle(server)
    assert _delta(after, before, 'serve_request_success_total{finished_reason="abort"}') == 1
    # Not a finished request: no end-to-end latency for it.
    assert _delta(after, before, "serve_e2e_request_latency_seconds_count") == 0


# What vLLM's example Grafana dashboard (examples/online_serving/prometheus_grafana)
# queries, each with {model_name="$model_name"}.
VLLM_DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:num_requests_running",
    "vllm:num_requests_swapped",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:gpu_cache_usage_perc",
    "vllm:cpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
    # and the newer names
    "vllm:kv_cache_usage_perc",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
)


def test_vllm_names_serve_vllms_dashboard(server_factory):
    from prometheus_client.parser import text_string_to_metric_families

    server = server_factory("--metrics-names", "vllm", "--served-model-name", "tiny-vllm")
    body = {"model": server.model, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
    assert httpx.post(f"{server.v1}/completions", json=body, timeout=60).status_code == 200
    wait_until_idle(server)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).add(sample.labels.get("model_name", ""))
    missing = [name for name in VLLM_DASHBOARD_SERIES if "tiny-vllm" not in series.get(name, ())]
    assert not missing, f"not on /metrics with model_name: {missing}"
    # The serve_ prefix is gone from the shared series; serve's own keep theirs.
    assert "serve_time_to_first_token_seconds_count" not in series
    assert "serve_kv_cache_blocks_total" in series
