"""Server-sent events as they go over the wire, read with raw httpx: framing, chunk order,
the usage chunk and [DONE]."""

from __future__ import annotations

import json
import re
import time

import pytest

from serve.api.sse import sse

MESSAGES = [{"role": "user", "content": "Please write a short poem about the sea."}]
PROMPT = "The sea is wide and blue"


def sse_events(http, path: str, body: dict) -> list[str]:
    """The `data:` payloads of a streamed response, checking the framing on the way:
    events are `data: ...` lines, each event ends with a blank line."""
    with http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    assert raw.endswith("\n\n"), raw[-200:]
    events = raw[: -len("\n\n")].split("\n\n")
    payloads = []
    for event in events:
        lines = event.split("\n")
        assert len(lines) == 1 and lines[0].startswith("data: "), repr(event)
        payloads.append(lines[0][len("data: ") :])
    return payloads


def parse(payloads: list[str]) -> list[dict]:
    assert payloads[-1] == "[DONE]"
    assert "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def test_chat_stream_framing(http, server):
    body = {"model": server.model, "messages": MESSAGES, "temperature": 0, "max_tokens": 10}
    full = http.post("/v1/chat/completions", json=body).json()
    chunks = parse(
        sse_events(
            http,
            "/v1/chat/completions",
            {**body, "stream": True, "stream_options": {"include_usage": True}},
        )
    )
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["model"] == server.model for c in chunks)

    first, *middle, usage_chunk = chunks
    assert first["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert content == full["choices"][0]["message"]["content"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert [f for f in finish if f is not None] == [full["choices"][0]["finish_reason"]]
    assert finish[-1] is not None, "the finish chunk comes last among the choice chunks"
    # with include_usage: every chunk carries "usage": null, the last one the counts
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]


def test_chat_stream_without_usage(http, server):
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    chunks = parse(sse_events(http, "/v1/chat/completions", body))
    assert all(c["choices"] for c in chunks)
    assert all(c.get("usage") is None for c in chunks)


def test_chat_stream_n(http, server):
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 4, "n": 2, "stream": True}
    chunks = parse(sse_events(http, "/v1/chat/completions", body))
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(roles) == sorted(finished) == [0, 1]


def test_completion_stream_framing(http, server):
    body = {"model": server.model, "prompt": PROMPT, "temperature": 0, "max_tokens": 10}
    full = http.post("/v1/completions", json=body).json()
    chunks = parse(
        sse_events(
            http,
            "/v1/completions",
            {**body, "stream": True, "stream_options": {"include_usage": True}},
        )
    )
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    *choice_chunks, usage_chunk = chunks
    assert "".join(c["choices"][0]["text"] for c in choice_chunks) == full["choices"][0]["text"]
    assert choice_chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in choice_chunks[:-1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]


def test_continuous_usage_stats(http, server, tokenizer):
    """vLLM's `continuous_usage_stats`: every chunk carries its choice's usage so far (its
    own prompt's tokens, the tokens it has sent); the last chunk has the totals."""
    prompts = [PROMPT, "Hi"]
    body = {
        "model": server.model,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    *choice_chunks, last = parse(sse_events(http, "/v1/completions", body))
    num_prompt = [len(tokenizer(p).input_ids) for p in prompts]
    seen = {0: 0, 1: 0}
    for chunk in choice_chunks:
        (choice,) = chunk["choices"]
        index, usage = choice["index"], chunk["usage"]
        assert usage["prompt_tokens"] == num_prompt[index]
        assert usage["completion_tokens"] >= seen[index]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        seen[index] = usage["completion_tokens"]
    assert seen == {0: 5, 1: 5}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    assert last["usage"]["prompt_tokens"] == sum(num_prompt)

    chat_body = {
        "model": server.model,
        "messages": MESSAGES,
        "max_tokens": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    *chat_chunks, chat_last = parse(sse_events(http, "/v1/chat/completions", chat_body))
    num_chat_prompt = chat_last["usage"]["prompt_tokens"]
    assert chat_chunks[0]["usage"] == {
        "prompt_tokens": num_chat_prompt,
        "completion_tokens": 0,  # the role chunk
        "total_tokens": num_chat_prompt,
    }
    assert chat_chunks[-1]["usage"] == chat_last["usage"]


def test_an_event_is_one_json_line_with_text_kept_and_line_breaks_escaped():
    """The encoder's own contract, without a server: other text stays UTF-8 as it is (not
    \\u escapes), every character that ends a line for some client is escaped, and a
    float JSON cannot hold is null, not a token a JSON parser rejects."""
    text = "café ☕ one\ntwo\rthree\u2028four\x85five\u2029six"
    event = sse({"text": text, "logprob": float("nan"), "low": float("-inf")}, event="delta")
    head, data = event.split(b"\n", 1)
    assert head == b"event: delta"
    assert data.startswith(b"data: ") and data.endswith(b"\n\n")
    line = data[len(b"data: ") : -2]
    assert "café ☕".encode() in line
    assert not any(c in line.decode() for c in "\n\r\x85\u2028\u2029")
    assert json.loads(line) == {"text": text, "logprob": None, "low": None}


def test_text_with_unicode_line_separators_stays_in_its_event(http, server):
    """U+0085, U+2028 and U+2029 end a line for Python's splitlines, which httpx's
    `aiter_lines` follows: in a token's text they must not cut a `data:` line in two."""
    prompt = "one\u2028two\x85three\u2029four"
    body = {"model": server.model, "prompt": prompt, "echo": True, "max_tokens": 2}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[len("data: ") :])["choices"][0]["text"] for line in lines[:-1])
    assert text.startswith(prompt)


def test_streamed_logprobs_match(http, server):
    body = {
        "model": server.model,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 6,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    full = http.post("/v1/chat/completions", json=body).json()
    chunks = parse(sse_events(http, "/v1/chat/completions", {**body, "stream": True}))
    streamed = [
        entry
        for c in chunks
        if c["choices"][0]["logprobs"]
        for entry in c["choices"][0]["logprobs"]["content"]
    ]
    expected = full["choices"][0]["logprobs"]["content"]

    # The same tokens, with the same alternatives, in the same order. The values agree to
    # float32 rounding: the second request may reuse the first one's cached prompt blocks,
    # and a prefill of fewer rows sums in another order on CPU (oneDNN blocks by rows).
    def tokens(entries: list[dict]) -> list:
        return [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in entries]

    def values(entries: list[dict]) -> list[float]:
        return [
            v for e in entries for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))
        ]

    assert tokens(streamed) == tokens(expected)
    assert values(streamed) == pytest.approx(values(expected), abs=1e-4)


def test_bad_stream_request_is_a_json_error_not_a_stream(http, server):
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 10**6, "stream": True}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.json()["error"]["code"] == "context_length_exceeded"


def test_access_log_counts_a_finished_stream(http, server):
    body = {"model": server.model, "prompt": list(range(3, 40)), "max_tokens": 5, "stream": True}
    body["ignore_eos"] = True
    parse(sse_events(http, "/v1/completions", body))
    line = re.compile(r'"POST /v1/completions" 200 prompt_tokens=37 completion_tokens=5 ')
    deadline = time.monotonic() + 5
    while not line.search(server.log()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert line.search(server.log()), server.log()[-2000:]
