"""`vllm serve` front-end flags that copied command lines carry: --enable-log-requests
with --max-log-len, --response-role, --enable-server-load-tracking with GET /load, and
the cache_config_info series on /metrics. One server runs with all of them (and an API
key, which no log line may show); the default server shows what happens without them."""

from __future__ import annotations

import json
import logging
import re
import time
from types import SimpleNamespace

import httpx
import pytest
from api.conftest import wait_until_idle

from serve.api.protocol import CompletionRequest
from serve.api.settings import ServerSettings
from serve.lora_request import LoRARequest

API_KEY = "sk-test-flags-5e1f0c"
MAX_LOG_LEN = 40
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # 180 characters
LOG_LINE = re.compile(
    r"Received request (?P<id>\S+): prompt: (?P<prompt>.*), params: (?P<params>.*), "
    r"prompt_token_ids: (?P<ids>\[[\d, ]*\]), lora_request: (?P<lora>.*)\.$"
)


@pytest.fixture(scope="module")
def flagged(server_factory, long_context_model):
    return server_factory(
        "--max-model-len",
        "4096",
        "--api-key",
        API_KEY,
        "--metrics-public",
        "--enable-log-requests",
        "--max-log-len",
        str(MAX_LOG_LEN),
        "--response-role",
        "narrator",
        "--enable-server-load-tracking",
        "--metrics-names",
        "vllm",
        "--block-size",
        "32",
        "--no-enable-prefix-caching",
        model=long_context_model,
    )


def logged_requests(server, timeout_s: float = 10.0, until: str | None = None) -> dict:
    """The server log's request lines by request id (waiting up to `timeout_s` for the
    one whose id starts with `until`: the log is another process's file)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = {}
        for line in server.log().splitlines():
            match = LOG_LINE.search(line)
            if match:
                lines[match["id"]] = match
        if until is None or any(i.startswith(until) for i in lines):
            return lines
        if time.monotonic() > deadline:
            pytest.fail(f"no request line for {until} in the log:\n{server.log()}")
        time.sleep(0.1)


# -- --enable-log-requests, --max-log-len -----------------------------------------------------


def test_a_request_is_logged_with_its_prompt_cut_to_max_log_len_and_its_params(flagged, server):
    body = {"prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0, "seed": 7}
    resp = httpx.post(f"{flagged.v1}/completions", json=body, headers=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    request_id = f"{resp.json()['id']}-0"  # a completion's prompts are numbered
    line = logged_requests(flagged, until=request_id)[request_id]
    assert line["prompt"] == repr(LONG_PROMPT[:MAX_LOG_LEN])
    ids = httpx.post(f"{flagged.url}/tokenize", json={"prompt": LONG_PROMPT}, headers=AUTH)
    assert json.loads(line["ids"]) == ids.json()["tokens"][:MAX_LOG_LEN]
    assert line["params"].startswith("SamplingParams(")
    for field in ("max_tokens=2", "temperature=0.0", "seed=7"):
        assert field in line["params"]
    log = flagged.log()
    assert "INFO serve.api.request_log: Received request" in log
    assert API_KEY not in log and "Bearer" not in log and "authorization" not in log.lower()
    # Without the flag, a request's content is never logged.
    marker = "a prompt that only the default server ever sees"
    done = httpx.post(f"{server.v1}/completions", json={"prompt": marker, "max_tokens": 1})
    assert done.status_code == 200
    assert marker not in server.log() and "Received request" not in server.log()


def test_every_generation_endpoint_logs_its_requests(flagged):
    def post(path: str, body: dict, headers: dict | None = None) -> dict:
        resp = httpx.post(f"{flagged.v1}{path}", json=body, headers=AUTH | (headers or {}))
        assert resp.status_code == 200, resp.text
        return resp.json()

    hello = [{"role": "user", "content": "Hello"}]
    ids = [
        post("/chat/completions", {"messages": hello, "max_tokens": 2})["id"],
        post("/responses", {"input": "Hello", "max_output_tokens": 2})["id"],
        post(
            "/messages",
            {"model": flagged.model, "messages": hello, "max_tokens": 2},
            {"anthropic-version": "2023-06-01"},
        )["id"],
    ]
    post("/embeddings", {"input": "Embed me"})
    post("/embeddings", {"input": [5, 6, 7]})
    lines = logged_requests(flagged, until="embd-")
    for request_id in ids:
        assert lines[request_id]["params"].startswith("SamplingParams("), request_id
    embedded = [m for i, m in lines.items() if i.startswith("embd-") and i.endswith("-0")]
    (text,) = [m for m in embedded if m["prompt"] == "'Embed me'"]
    (token_ids,) = [m for m in embedded if m["ids"] == "[5, 6, 7]"]
    assert token_ids["prompt"] == "None"
    assert text["params"].startswith("PoolingParams(")  # as vLLM logs a pooling request


def test_the_log_line_goes_through_the_one_place_requests_reach_the_engine(caplog):
    """open_stream, which every generation endpoint calls: one INFO record per request,
    the prompt's text and ids cut to max_log_len; nothing when logging is off."""
    from serve.api.request_log import RequestLog
    from serve.api.serving_base import open_stream

    engine = SimpleNamespace(check_params=lambda params: None, generate=lambda *a, **k: None)
    request = CompletionRequest(prompt="unused", max_tokens=3)
    logged = ServerSettings("m", "/m", request_log=RequestLog(True, max_log_len=5))
    with caplog.at_level(logging.INFO, logger="serve.api.request_log"):
        open_stream(
            engine, logged, request, "cmpl-1-0", list(range(100, 120)), "abcdefghij", 3, None
        )
        open_stream(engine, ServerSettings("m", "/m"), request, "cmpl-2-0", [1], "secret", 3, None)
        sql = LoRARequest("sql", 1, "/adapters/sql")
        open_stream(engine, logged, request, "cmpl-3-0", [7], "x", 3, None, lora_request=sql)
    first, with_adapter = caplog.records
    assert first.levelno == logging.INFO
    message = first.getMessage()
    assert message.startswith("Received request cmpl-1-0: prompt: 'abcde', params: SamplingParams(")
    assert "max_tokens=3" in message
    assert message.endswith("prompt_token_ids: [100, 101, 102, 103, 104], lora_request: None.")
    # The adapter a request runs with, as vLLM logs it.
    assert with_adapter.getMessage().endswith(
        "lora_request: LoRARequest(lora_name='sql', lora_int_id=1, "
        "lora_path='/adapters/sql', base_model_name=None)."
    )


# -- --response-role ---------------------------------------------------------------------


def sse_events(resp: httpx.Response) -> list[dict]:
    return [
        json.loads(line[len("data: ") :])
        for line in resp.iter_lines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_the_response_role_names_the_reply_after_a_generation_prompt(flagged, server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    url = f"{flagged.v1}/chat/completions"
    reply = httpx.post(url, json=body, headers=AUTH, timeout=60).json()
    assert reply["choices"][0]["message"]["role"] == "narrator"
    with httpx.stream("POST", url, json={**body, "stream": True, "n": 2}, headers=AUTH) as resp:
        events = sse_events(resp)
    first = [e["choices"][0] for e in events[:2]]
    assert [(c["index"], c["delta"]) for c in first] == [
        (0, {"role": "narrator", "content": ""}),
        (1, {"role": "narrator", "content": ""}),
    ]
    # The default server's role is "assistant".
    default = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60).json()
    assert default["choices"][0]["message"]["role"] == "assistant"


def test_without_a_generation_prompt_the_role_is_the_last_messages(flagged):
    """vLLM's rule: the model continues the last message, so the reply carries its role."""
    messages = [
        {"role": "user", "content": "Write a line."},
        {"role": "assistant", "content": "Once"},
    ]
    body = {
        "messages": messages,
        "max_tokens": 2,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    url = f"{flagged.v1}/chat/completions"
    reply = httpx.post(url, json=body, headers=AUTH, timeout=60).json()
    assert reply["choices"][0]["message"]["role"] == "assistant"
    user_last = {"messages": messages[:1], "max_tokens": 2, "add_generation_prompt": False}
    reply = httpx.post(url, json=user_last, headers=AUTH, timeout=60).json()
    assert reply["choices"][0]["message"]["role"] == "user"
    with httpx.stream("POST", url, json={**user_last, "stream": True}, headers=AUTH) as resp:
        (first, *_) = sse_events(resp)
    assert first["choices"][0]["delta"] == {"role": "user", "content": ""}


# -- --enable-server-load-tracking, GET /load ----------------------------------------------


def server_load(server, headers: dict | None = None) -> int:
    resp = httpx.get(f"{server.url}/load", headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()["server_load"]


def wait_for_load(server, expected: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (load := server_load(server)) != expected:
        assert time.monotonic() < deadline, f"/load stayed {load}, expected {expected}"
        time.sleep(0.05)


def test_load_counts_a_request_in_flight_until_it_ends(flagged, server):
    wait_for_load(flagged, 0)
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{flagged.v1}/completions", json=body, headers=AUTH, timeout=60
    ) as resp:
        lines = (line for line in resp.iter_lines() if line.startswith("data: "))
        for _ in range(5):
            next(lines)
        assert server_load(flagged, AUTH) == 1
        # /load and /metrics are not generation requests: they do not count. Like
        # /health, /load needs no key: a load balancer polls it.
        assert server_load(flagged) == 1
    wait_for_load(flagged, 0)  # the client hung up: the request is gone
    # Without the flag /load is there all the same, and says 0, as vLLM's does.
    assert server_load(server) == 0


# -- cache_config_info ------------------------------------------------------------------


def cache_config_labels(server, name: str) -> dict[str, str]:
    samples = wait_until_idle(server)
    (key,) = [k for k in samples if k.startswith(name + "{")]
    assert samples[key] == 1
    labels = dict(re.findall(r'(\w+)="([^"]*)"', key))
    return {**labels, "_blocks_total": str(int(samples["serve_kv_cache_blocks_total"]))}


def test_cache_config_info_carries_the_cache_settings_and_block_counts(flagged, server):
    labels = cache_config_labels(flagged, "vllm:cache_config_info")
    assert labels.pop("num_gpu_blocks") == labels.pop("_blocks_total") != "0"
    assert int(labels.pop("num_cpu_blocks")) > 0  # the swap space's, 4 GiB by default
    assert labels == {
        "block_size": "32",
        "cache_dtype": "auto",
        "enable_prefix_caching": "False",
        "gpu_memory_utilization": "0.9",
        "kv_cache_memory_bytes": str(64 * 2**20),  # the tests' --kv-cache-memory 64MiB
        "num_gpu_blocks_override": "None",
        "swap_space": "4.0",
        "engine": "0",
    }
    default = cache_config_labels(server, "serve_cache_config_info")
    assert default["num_gpu_blocks"] == default["_blocks_total"]
    assert default["block_size"] == "16" and default["enable_prefix_caching"] == "True"
