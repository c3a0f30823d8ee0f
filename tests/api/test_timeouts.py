"""`--request-timeout` stops a request that runs too long with a 504 (an error event when
streamed) and frees its blocks; `--grammar-compile-timeout` refuses a request whose
grammar takes too long to compile with a 400."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from api.conftest import wait_until_idle
from api.openai_errors import assert_openai_error

# Short beside the 4000 tokens the requests ask for: the tiny model writes them in ~1.7 s
# at batch 1 on a 2-core machine (it took over 2 s before its layers ran as one native
# call), so a request still runs at the deadline.
TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def server(server_factory, long_context_model):
    return server_factory(
        "--max-model-len",
        "4096",
        "--request-timeout",
        str(TIMEOUT_S),
        "--grammar-compile-timeout",
        "0.001",
        model=long_context_model,
    )


def _long(server, **fields) -> dict:
    return {
        "model": server.model,
        "prompt": "Once upon a time",
        "max_tokens": 4000,
        "ignore_eos": True,
        **fields,
    }


def test_a_request_past_the_deadline_is_a_504(server):
    start = time.monotonic()
    response = httpx.post(f"{server.v1}/completions", json=_long(server), timeout=60)
    elapsed = time.monotonic() - start
    error = assert_openai_error(response, 504)
    assert error["type"] == "timeout_error"
    assert "--request-timeout" in error["message"]
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 3
    assert wait_until_idle(server)["serve_kv_cache_blocks_used"] == 0


def test_the_sdks_do_not_retry_a_timeout(server):
    """The OpenAI SDK retries a 5xx twice by default: a 504 ran the request three times
    (three deadlines, three times the engine's work) to the same end. It says not to."""
    sent = []
    http_client = httpx.Client(event_hooks={"request": [sent.append]})
    client = openai.OpenAI(
        base_url=server.v1, api_key="unused", max_retries=2, http_client=http_client
    )
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(
            model=server.model, prompt="Once upon a time", max_tokens=4000,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    assert e.value.status_code == 504
    assert e.value.response.headers["x-should-retry"] == "false"
    assert len(sent) == 1  # one attempt


def test_a_stream_past_the_deadline_ends_with_an_error_event(server):
    request = _long(server, stream=True)
    with httpx.stream("POST", f"{server.v1}/completions", json=request, timeout=60) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "timeout_error"
    assert len(events) > 3  # tokens streamed before the deadline
    assert wait_until_idle(server)["serve_kv_cache_blocks_used"] == 0


def test_requests_within_the_deadline_are_untouched(server):
    response = httpx.post(f"{server.v1}/completions", json=_long(server, max_tokens=8), timeout=60)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 8


def test_a_grammar_slower_to_compile_than_its_timeout_is_a_400(server):
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}}
    response = httpx.post(
        f"{server.v1}/completions",
        json=_long(
            server,
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"schema": schema}},
        ),
        timeout=60,
    )
    error = assert_openai_error(response, 400, "response_format")
    assert "--grammar-compile-timeout" in error["message"]
