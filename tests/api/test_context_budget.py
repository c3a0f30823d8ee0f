"""A prompt and max_tokens that together overflow the context window run, their budget cut
to the room the prompt leaves, and end with finish_reason "length" (vLLM's
`get_max_tokens`) on every generating endpoint. Only a max_tokens over the whole window,
or a prompt that leaves no room for one token, is a 400."""

from __future__ import annotations

import httpx
import pytest
from api.openai_errors import assert_openai_error

MAX_MODEL_LEN = 512  # the tiny llama's window, the default server's
OVER = 5  # tokens a request asks for past the room its prompt leaves
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def long_chat(http, server) -> tuple[list[dict], int]:
    """Messages whose prompt leaves a few tokens of room, and that room."""

    def num_tokens(words: int) -> int:
        messages = [{"role": "user", "content": "hello " * words}]
        counted = http.post("/tokenize", json={"messages": messages})
        assert counted.status_code == 200, counted.text
        return counted.json()["count"]

    per_word = (num_tokens(20) - num_tokens(10)) // 10
    words = (MAX_MODEL_LEN - 12 - num_tokens(0)) // per_word
    messages = [{"role": "user", "content": "hello " * words}]
    prompt_len = num_tokens(words)
    room = MAX_MODEL_LEN - prompt_len
    assert 0 < room < 40, prompt_len
    return messages, room


def test_completions_budget_shrinks_to_the_room_left(http, server):
    prompt = [3 + i % 500 for i in range(MAX_MODEL_LEN - 7)]
    body = {"model": server.model, "prompt": prompt, "max_tokens": 7 + OVER, "ignore_eos": True}
    reply = http.post("/v1/completions", json={**body, **GREEDY})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 7
    assert reply.json()["choices"][0]["finish_reason"] == "length"
    # A max_tokens of the whole window is not over it: cut to the room too.
    whole = http.post("/v1/completions", json={**body, "max_tokens": MAX_MODEL_LEN})
    assert whole.status_code == 200, whole.text
    assert whole.json()["usage"]["completion_tokens"] == 7


def test_chat_budget_shrinks_to_the_room_left(http, server, long_chat):
    messages, room = long_chat
    for field in ("max_tokens", "max_completion_tokens"):
        body = {"model": server.model, "messages": messages, field: room + OVER}
        reply = http.post("/v1/chat/completions", json={**body, **GREEDY, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == room
        assert reply.json()["choices"][0]["finish_reason"] == "length"


def test_responses_budget_shrinks_to_the_room_left(server, long_chat):
    messages, room = long_chat
    body = {
        "model": server.model,
        "input": messages[0]["content"],
        "max_output_tokens": room + OVER,
        "ignore_eos": True,
        **GREEDY,
    }
    reply = httpx.post(f"{server.v1}/responses", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["output_tokens"] == room
    assert reply.json()["status"] == "incomplete"
    assert reply.json()["incomplete_details"] == {"reason": "max_output_tokens"}


def test_anthropic_messages_budget_shrinks_to_the_room_left(server, long_chat):
    """Anthropic's max_tokens is required, and clients send large ones: as on vLLM (and
    as Anthropic's own API does past Claude 3.7's strict check), the output stops at the
    window, with stop_reason "max_tokens"."""
    messages, room = long_chat
    body = {"model": server.model, "messages": messages, "max_tokens": room + OVER, **GREEDY}
    reply = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["output_tokens"] == room
    assert reply.json()["stop_reason"] == "max_tokens"


@pytest.mark.parametrize(
    ("path", "field", "param"),
    [
        ("/v1/completions", "max_tokens", "max_tokens"),
        ("/v1/chat/completions", "max_tokens", "max_tokens"),
        ("/v1/chat/completions", "max_completion_tokens", "max_completion_tokens"),
        ("/v1/responses", "max_output_tokens", "max_output_tokens"),
    ],
)
def test_a_max_tokens_over_the_whole_window_is_400(http, server, path, field, param):
    body = {"model": server.model, field: MAX_MODEL_LEN + 1}
    if path == "/v1/completions":
        body["prompt"] = "Hi"
    elif path == "/v1/responses":
        body["input"] = "Hi"
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    error = assert_openai_error(http.post(path, json=body), 400, param)
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert f"{MAX_MODEL_LEN + 1} for the completion" in error["message"]


def test_a_prompt_that_leaves_no_room_is_400_naming_it(http, server):
    full = [3 + i % 500 for i in range(MAX_MODEL_LEN)]
    for fields in ({}, {"max_tokens": 1}):
        refused = http.post(
            "/v1/completions", json={"model": server.model, "prompt": full, **fields}
        )
        error = assert_openai_error(refused, 400, "prompt")
        assert error["code"] == "context_length_exceeded"
        assert f"your prompt resulted in {MAX_MODEL_LEN} tokens" in error["message"]
        assert "no room for the completion" in error["message"]
    messages = [{"role": "user", "content": "hello " * 600}]
    refused = http.post("/v1/chat/completions", json={"model": server.model, "messages": messages})
    error = assert_openai_error(refused, 400, "messages")
    assert "your messages resulted in" in error["message"]
