"""Admission before any work: a full queue gets 503 with Retry-After at once while the
accepted requests complete; a body over the cap gets 413, by its length or as it arrives;
the model card never shows the server's filesystem."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from api.conftest import start_server, stop_process
from api.openai_errors import assert_openai_error

NUM_TOKENS = 600


def _stream_usage(server, results: list, started: threading.Event) -> None:
    body = {
        "model": server.model,
        "prompt": "Once upon a time",
        "max_tokens": NUM_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=120) as response:
        started.set()  # headers: past admission (a random model's text may come late)
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    results.append(json.loads(events[-2])["usage"]["completion_tokens"])


def test_a_full_queue_answers_503_at_once_and_serves_the_accepted(long_context_model, tmp_path):
    args = ("--max-model-len", "4096", "--max-num-seqs", "2", "--max-num-queued-requests", "1")
    server = start_server(long_context_model, args, {}, tmp_path)
    try:
        results: list[int] = []
        threads = []
        for _ in range(3):  # two running, one queued: the cap
            started = threading.Event()
            thread = threading.Thread(target=_stream_usage, args=(server, results, started))
            thread.start()
            threads.append((thread, started))
        for _, started in threads:
            assert started.wait(60)
        sent = time.monotonic()
        refused = httpx.post(
            f"{server.v1}/completions",
            json={"model": server.model, "prompt": "Hi", "max_tokens": 2},
            timeout=30,
        )
        refused_s = time.monotonic() - sent
        health = httpx.get(f"{server.url}/health", timeout=10)
        for thread, _ in threads:
            thread.join(120)
        after = httpx.post(
            f"{server.v1}/completions",
            json={"model": server.model, "prompt": "Hi", "max_tokens": 2},
            timeout=30,
        )
    finally:
        stop_process(server.process)

    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["type"] == "service_unavailable_error"
    assert "--max-num-queued-requests" in error["message"]
    assert refused_s < 2
    assert health.status_code == 200  # only generation is capped
    assert results == [NUM_TOKENS] * 3
    assert after.status_code == 200


@pytest.fixture(scope="module")
def capped_server(server_factory):
    return server_factory("--max-request-body-bytes", "2000", "--served-model-name", "tiny")


def test_a_body_over_the_cap_is_413(capped_server):
    url = f"{capped_server.v1}/completions"
    small = {"model": capped_server.model, "prompt": "Hi", "max_tokens": 2}
    big = {**small, "prompt": "word " * 1000}
    assert httpx.post(url, json=small, timeout=30).status_code == 200
    error = assert_openai_error(httpx.post(url, json=big, timeout=30), 413)
    assert error["type"] == "invalid_request_error"
    assert "--max-request-body-bytes" in error["message"]
    assert httpx.post(url, json=small, timeout=30).status_code == 200  # serving on


def test_a_chunked_body_over_the_cap_is_413(capped_server):
    """No Content-Length to go by: the cap applies as the body arrives."""
    body = json.dumps({"model": capped_server.model, "prompt": "word " * 1000}).encode()
    chunks = (body[i : i + 500] for i in range(0, len(body), 500))
    headers = {"Content-Type": "application/json"}
    response = httpx.post(
        f"{capped_server.v1}/completions", content=chunks, headers=headers, timeout=30
    )
    assert response.status_code == 413


def test_a_chunked_body_under_the_cap_is_served(capped_server):
    body = json.dumps({"model": capped_server.model, "prompt": "Hi", "max_tokens": 2}).encode()
    chunks = (body[i : i + 10] for i in range(0, len(body), 10))
    headers = {"Content-Type": "application/json"}
    response = httpx.post(
        f"{capped_server.v1}/completions", content=chunks, headers=headers, timeout=30
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_the_model_card_names_the_model_not_its_path(capped_server):
    card = httpx.get(f"{capped_server.v1}/models", timeout=10).json()["data"][0]
    assert card["root"] == card["id"] == "tiny"
    assert "/" not in json.dumps(card)


def test_a_burst_arriving_together_is_capped_too():
    """Requests whose bodies are still arriving count against the cap: a burst that all
    passed the check before any body was read went through whole."""
    import asyncio

    from serve.api.admission import Admission, AdmissionGate

    async def burst() -> list[int]:
        release = asyncio.Event()

        async def app(scope, receive, send):
            await receive()
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        gate = AdmissionGate(app, Admission(max_generating=2, max_body_bytes=1000))

        async def one() -> int:
            statuses = []

            async def receive():
                await asyncio.sleep(0.01)  # the body arrives after the others' checks
                return {"type": "http.request", "body": b"{}", "more_body": False}

            async def send(message):
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])
                    if message["status"] == 503:
                        release.set()  # refusals are in: let the admitted ones finish

            scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
            await gate(scope, receive, send)
            return statuses[0]

        # Without refusals nothing would release the admitted: they would wait for ever.
        asyncio.get_running_loop().call_later(2.0, release.set)
        return await asyncio.wait_for(asyncio.gather(*(one() for _ in range(6))), 30)

    statuses = asyncio.run(burst())
    assert sorted(statuses) == [200, 200, 503, 503, 503, 503]
