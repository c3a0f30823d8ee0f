"""A client's own request id names its response, as in vLLM: `chatcmpl-<id>` / `cmpl-<id>`
from the X-Request-Id header or the body's `request_id` (the header wins), streamed or not,
and two requests in flight may carry the same one."""

from __future__ import annotations

import asyncio
import json

import httpx
from api.openai_errors import assert_openai_error

MESSAGES = [{"role": "user", "content": "Hello!"}]


def chat(server, **fields) -> dict:
    return {"model": server.model, "messages": MESSAGES, "max_tokens": 4, **fields}


def completion(server, **fields) -> dict:
    return {"model": server.model, "prompt": "The quick brown fox", "max_tokens": 4, **fields}


def _stream_ids(http, path: str, body: dict, headers: dict) -> set[str]:
    with http.stream("POST", path, json={**body, "stream": True}, headers=headers) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: {")]
    return {json.loads(line[len("data: ") :])["id"] for line in lines}


def test_the_header_names_the_response(http, server):
    headers = {"X-Request-Id": "trace-42"}
    resp = http.post("/v1/chat/completions", json=chat(server), headers=headers)
    assert resp.status_code == 200 and resp.json()["id"] == "chatcmpl-trace-42"
    assert resp.headers["x-request-id"] == "trace-42"
    resp = http.post("/v1/completions", json=completion(server), headers=headers)
    assert resp.json()["id"] == "cmpl-trace-42"
    assert _stream_ids(http, "/v1/chat/completions", chat(server), headers) == {"chatcmpl-trace-42"}
    assert _stream_ids(http, "/v1/completions", completion(server, n=2), headers) == {
        "cmpl-trace-42"
    }


def test_embeddings_are_named_alike(http, server):
    body = {"model": server.model, "input": "Hi"}
    headers = {"X-Request-Id": "emb-9"}
    assert http.post("/v1/embeddings", json=body, headers=headers).json()["id"] == "embd-emb-9"
    named = http.post("/v1/embeddings", json={**body, "request_id": "e1"}).json()
    assert named["id"] == "embd-e1" and len(named["data"]) == 1
    assert http.post("/v1/embeddings", json=body).json()["id"].startswith("embd-")


def test_the_body_field_names_it_unless_the_header_does(http, server):
    body = completion(server, request_id="mine-1")
    assert http.post("/v1/completions", json=body).json()["id"] == "cmpl-mine-1"
    resp = http.post("/v1/completions", json=body, headers={"X-Request-Id": "theirs"})
    assert resp.json()["id"] == "cmpl-theirs"
    # Without either, each response gets its own random id.
    ids = {http.post("/v1/chat/completions", json=chat(server)).json()["id"] for _ in range(2)}
    assert len(ids) == 2 and all(i.startswith("chatcmpl-") for i in ids)


def test_a_body_request_id_that_is_not_plain_is_400(http, server):
    resp = http.post("/v1/completions", json=completion(server, request_id="a b\n"))
    assert_openai_error(resp, 400, "request_id")


def test_requests_in_flight_may_share_an_id(server):
    """The engine's ids stay unique: the same client id twice at once runs both."""

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            body = chat(server, max_tokens=12, ignore_eos=True)
            headers = {"X-Request-Id": "retry-7"}
            return await asyncio.gather(
                *(http.post("/v1/chat/completions", json=body, headers=headers) for _ in range(2))
            )

    responses = asyncio.run(both())
    assert [r.status_code for r in responses] == [200, 200]
    assert [r.json()["id"] for r in responses] == ["chatcmpl-retry-7"] * 2
    assert [r.json()["usage"]["completion_tokens"] for r in responses] == [12, 12]
