"""Bad input never reaches a 500: each kind gets its status in OpenAI's error shape, with
`param` naming the offending field, and the server goes on serving, on the same keep-alive
connection. (A body over the size cap, 413, is in test_admission.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest
from api.openai_errors import assert_openai_error

from serve.engine.request_metrics import RequestMetrics

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hello!"}]


def chat(server, **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "messages": MESSAGES, "max_tokens": 2, **fields}


def completion(server, **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "prompt": "Hi", "max_tokens": 2, **fields}


def post_json(http: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    """`body` encoded by `json.dumps`, which writes what httpx's encoder refuses (NaN,
    Infinity) and escapes lone surrogates as `\\ud800`."""
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def _local_address(response: httpx.Response) -> tuple[str, int]:
    return response.extensions["network_stream"].get_extra_info("client_addr")


def assert_still_serving(http: httpx.Client, server, refused: httpx.Response) -> None:
    """A normal request completes, on the connection that carried the refused one."""
    response = http.post(COMPLETIONS, json=completion(server))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    assert _local_address(response) == _local_address(refused), "the connection was dropped"


# -- the body: JSON, an object, sent as JSON --------------------------------------------


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b'{"messages": [', "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, not an array"),
        (b'"Hello"', "must be a JSON object, not a string"),
        (b"null", "must be a JSON object, not null"),
        (b"", "empty"),
        (b'{"prompt": "\xff"}', "not valid UTF-8"),
        (b"[" * 100_000, "nests more than 64"),  # past what Python's parser recurses to
        (b'{"guided_json": ' + b'{"a": ' * 64 + b"{}" + b"}" * 64 + b"}", "nests more than 64"),
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", "integer of more than"),
    ],
    ids=[
        "malformed",
        "array",
        "string",
        "null",
        "empty",
        "not-utf8",
        "deepest",
        "deep-schema",
        "long-integer",
    ],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/tokenize"])
def test_a_body_that_is_not_a_json_object_is_400(http, server, path, body, words):
    refused = http.post(path, content=body, headers={"content-type": "application/json"})
    error = assert_openai_error(refused, 400)
    assert error["param"] is None and error["type"] == "invalid_request_error"
    assert words in error["message"]
    assert_still_serving(http, server, refused)


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_a_body_not_sent_as_json_is_415(http, server, content_type):
    body = json.dumps(chat(server))
    refused = http.post(CHAT, content=body, headers={"content-type": content_type})
    error = assert_openai_error(refused, 415)
    assert "Content-Type: application/json" in error["message"]
    assert_still_serving(http, server, refused)


@pytest.mark.parametrize("content_type", [None, "application/json; charset=utf-8"])
def test_a_body_without_a_content_type_is_read_as_json(http, server, content_type):
    headers = {"content-type": content_type} if content_type else {}
    response = http.post(CHAT, content=json.dumps(chat(server)), headers=headers)
    assert response.request.headers.get("content-type") == content_type
    assert response.status_code == 200, response.text


# -- messages ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        (["Hello!"], "messages.0"),
        ([{"role": "wizard", "content": "Hi"}], "messages.0.role"),
        ([{"content": "Hi"}], "messages.0.role"),
        ([{"role": "user", "content": 5}], "messages.0.content"),
        ([{"role": "user", "content": {"text": "Hi"}}], "messages.0.content"),
        (
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
            "messages.0.content.0.type",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text"),
        ([{"role": "user"}], "messages.0.content"),
        ([{"role": "user", "content": None}], "messages.0.content"),
        ([{"role": "system"}, *MESSAGES], "messages.0.content"),
        ([{"role": "developer"}, *MESSAGES], "messages.0.content"),
        ([*MESSAGES, {"role": "tool", "tool_call_id": "call_1"}], "messages.1.content"),
        ([*MESSAGES, {"role": "assistant"}], "messages.1.content"),  # no content, no calls
    ],
    ids=[
        "empty",
        "not-an-object",
        "invalid-role",
        "no-role",
        "content-number",
        "content-object",
        "audio-part",
        "part-without-text",
        "user-without-content",
        "user-null-content",
        "system-without-content",
        "developer-without-content",
        "tool-without-content",
        "assistant-without-content-or-calls",
    ],
)
def test_bad_messages_are_400(http, server, messages, param):
    refused = post_json(http, CHAT, chat(server, messages=messages))
    error = assert_openai_error(refused, 400, param)
    assert error["message"].startswith(f"{param}: ")
    assert_still_serving(http, server, refused)


def test_null_for_an_optional_field_means_its_default(http, server):
    """The SDKs send null for a parameter passed as None; OpenAI's fields are nullable."""
    nulls = dict.fromkeys(["top_p", "n", "presence_penalty", "frequency_penalty", "stream"])
    body = chat(server, max_tokens=3, temperature=0)
    expected = post_json(http, CHAT, body).json()["choices"][0]["message"]["content"]
    replied = post_json(http, CHAT, {**body, **nulls, "logprobs": None})
    assert replied.status_code == 200, replied.text
    assert replied.json()["choices"][0]["message"]["content"] == expected
    nulls["temperature"] = None
    text = completion(server, echo=None, **nulls)
    assert post_json(http, COMPLETIONS, text).status_code == 200
    embedded = post_json(http, "/v1/embeddings", {"input": "Hi", "encoding_format": None})
    assert isinstance(embedded.json()["data"][0]["embedding"], list)  # the default: floats


def test_an_assistant_message_with_tool_calls_needs_no_content(http):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [*MESSAGES, {"role": "assistant", "tool_calls": [call]}]
    assert http.post("/tokenize", json={"messages": messages}).status_code == 200


# -- max_tokens and the context window ---------------------------------------------------


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, {"max_tokens": 0}, "max_tokens"),
        (CHAT, {"max_tokens": -1}, "max_tokens"),
        (CHAT, {"max_tokens": "x"}, "max_tokens"),
        (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
        (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"max_tokens": 10**12}, "max_tokens"),
    ],
)
def test_bad_max_tokens_are_400(http, server, path, fields, param):
    body = chat(server, **fields) if path == CHAT else completion(server, **fields)
    refused = post_json(http, path, body)
    assert_openai_error(refused, 400, param)
    assert_still_serving(http, server, refused)


def test_context_window_overflow_says_the_numbers(http, server):
    """Only a max_tokens over the whole window is refused (one that merely overflows it
    beside the prompt runs, cut to the room: test_context_budget.py)."""
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    body = {"model": server.model, "prompt": "Hi there", "max_tokens": max_model_len + 1}
    error = assert_openai_error(http.post(COMPLETIONS, json=body), 400, "max_tokens")
    assert error["code"] == "context_length_exceeded"
    assert str(max_model_len) in error["message"]
    prompt_len = len(http.post("/tokenize", json={"prompt": "Hi there"}).json()["tokens"])
    assert str(prompt_len + max_model_len + 1) in error["message"]

    long_prompt = [3 + i % 500 for i in range(max_model_len)]  # no room left for output
    refused = http.post(COMPLETIONS, json={"model": server.model, "prompt": long_prompt})
    error = assert_openai_error(refused, 400, "prompt")
    assert "no room for the completion" in error["message"]
    assert_still_serving(http, server, refused)


# -- sampling values --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "fields", "param", "words"),
    [
        (CHAT, {"temperature": -0.5}, "temperature", ""),
        (CHAT, {"temperature": "hot"}, "temperature", ""),
        (CHAT, {"temperature": float("nan")}, "temperature", "finite"),
        (CHAT, {"temperature": float("inf")}, "temperature", "finite"),
        (CHAT, {"top_p": 0}, "top_p", ""),
        (CHAT, {"top_p": 1.5}, "top_p", ""),
        (CHAT, {"top_k": -2}, "top_k", ""),
        (CHAT, {"n": 0}, "n", ""),
        (CHAT, {"n": 129}, "n", "--max-n"),
        (COMPLETIONS, {"n": 2, "best_of": 129}, "best_of", "--max-n"),
        (COMPLETIONS, {"use_beam_search": True, "best_of": 10**6}, "best_of", "--max-n"),
        (COMPLETIONS, {"length_penalty": float("nan")}, "length_penalty", "finite"),
        (
            COMPLETIONS,
            {"use_beam_search": True, "best_of": 2, "temperature": 0, "length_penalty": 1e308},
            "length_penalty",
            "less than or equal to 10",
        ),
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "--max-logprobs"),
        (COMPLETIONS, {"logprobs": 21}, "logprobs", "--max-logprobs"),
        (COMPLETIONS, {"prompt_logprobs": 21}, "prompt_logprobs", "--max-logprobs"),
        (COMPLETIONS, {"seed": 2**70}, "seed", "64-bit"),
        (CHAT, {"seed": -(10**30)}, "seed", "64-bit"),
    ],
)
def test_sampling_values_out_of_range_are_400(http, server, path, fields, param, words):
    body = chat(server, **fields) if path == CHAT else completion(server, **fields)
    refused = post_json(http, path, body)
    error = assert_openai_error(refused, 400, param)
    assert words in error["message"]
    assert_still_serving(http, server, refused)


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (COMPLETIONS, {"prompt_logprobs": 1}, "prompt_logprobs"),
        (CHAT, {"prompt_logprobs": 0}, "prompt_logprobs"),
    ],
)
def test_prompt_logprobs_are_not_streamed(http, server, path, fields, param):
    """A streamed response has no place for vLLM's prompt_logprobs field: refused (as vLLM
    does), not dropped without a word. (Echo's prompt logprobs do stream: test_completions.)"""
    build = chat if path == CHAT else completion
    refused = post_json(http, path, build(server, stream=True, **fields))
    error = assert_openai_error(refused, 400, param)
    assert "stream" in error["message"]
    assert_still_serving(http, server, refused)


# -- stop lists and logit_bias ----------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"stop": 5}, "stop", ""),
        ({"stop": ["x", 5]}, "stop.1", ""),
        ({"stop": [f"s{i}" for i in range(65)]}, "stop", "--max-stop-sequences"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids", "--max-stop-sequences"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", ""),
        ({"bad_words": ["x"] * 100_000}, "bad_words", "--max-stop-sequences"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias", "token ids"),  # "²".isdigit()
        ({"logit_bias": {"100000": 1}}, "logit_bias", "[0, "),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"5": -101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"5": "x"}}, "logit_bias.5", ""),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "--max-logit-bias"),
    ],
)
def test_bad_stop_lists_and_logit_bias_are_400(http, server, fields, param, words):
    refused = post_json(http, COMPLETIONS, completion(server, **fields))
    error = assert_openai_error(refused, 400, param)
    assert words in error["message"]
    assert_still_serving(http, server, refused)


def test_request_limit_flags(server_factory):
    server = server_factory(
        "--max-n", "2", "--max-stop-sequences", "2", "--max-logit-bias", "2", "--max-logprobs", "2"
    )
    within = {"n": 2, "stop": ["a", "b"], "logit_bias": {"1": 1, "2": 1}, "logprobs": 2}
    over = [
        ({"n": 3}, "n", "--max-n"),
        ({"n": 2, "best_of": 3}, "best_of", "--max-n"),
        ({"stop": ["a", "b", "c"]}, "stop", "--max-stop-sequences"),
        ({"bad_words": ["a", "b", "c"]}, "bad_words", "--max-stop-sequences"),
        ({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias", "--max-logit-bias"),
        ({"logprobs": 3}, "logprobs", "--max-logprobs"),
    ]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post(COMPLETIONS, json=completion(server, **within)).status_code == 200
        for fields, param, flag in over:
            refused = http.post(COMPLETIONS, json=completion(server, **fields))
            error = assert_openai_error(refused, 400, param)
            assert f"at most 2 ({flag})" in error["message"]
        assert_still_serving(http, server, refused)


# -- lone surrogates --------------------------------------------------------------------

FUNCTION = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}]},
            "messages.0.content.0.text",
        ),
        (
            CHAT,
            {
                "tools": [{"type": "function", "function": {**FUNCTION, "description": "\udc00"}}],
                "tool_choice": "none",
            },
            "tools.0.function.description",
        ),
        (COMPLETIONS, {"prompt": "Hi \udbff"}, "prompt"),
        (COMPLETIONS, {"prompt": ["Hi", "\ud83d"]}, "prompt.1"),  # half of an emoji
        (COMPLETIONS, {"stop": ["\ud800"]}, "stop.0"),
        (COMPLETIONS, {"\ud800": 1}, "\\ud800"),  # an (unknown) field's name
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ],
    ids=[
        "message",
        "text-part",
        "tool-description",
        "prompt",
        "prompts",
        "stop",
        "key",
        "tokenize",
    ],
)
def test_lone_surrogates_are_400(http, server, path, fields, param):
    if path == CHAT:
        body = chat(server, **fields)
    elif path == COMPLETIONS:
        body = completion(server, **fields)
    else:
        body = fields
    refused = post_json(http, path, body)
    error = assert_openai_error(refused, 400, param)
    assert "surrogate" in error["message"]
    assert_still_serving(http, server, refused)


def test_surrogate_pairs_are_text(http, server):
    """json.dumps writes "😀" as the escaped pair \\ud83d\\ude00: one character."""
    body = completion(server, prompt="Hi 😀", stop=["😀"])
    assert "\\ud83d\\ude00" in json.dumps(body)
    assert post_json(http, COMPLETIONS, body).status_code == 200


# -- grammars ---------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "objectx"}}},
    },
}


@pytest.mark.parametrize(
    ("path", "fields", "param", "words"),
    [
        (
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            },
            "response_format",
            "objectx",
        ),
        (CHAT, {"tools": [WEATHER_TOOL], "tool_choice": "required"}, "tool_choice", "objectx"),
        (COMPLETIONS, {"guided_json": {"type": "objectx"}}, "guided_json", "objectx"),
        (COMPLETIONS, {"guided_regex": "[a-"}, "guided_regex", "Invalid regex"),
        (COMPLETIONS, {"guided_grammar": "root ::= nonsense"}, "guided_grammar", "grammar"),
    ],
    ids=["json-schema", "tools-schema", "guided-json", "regex", "grammar"],
)
def test_invalid_grammars_are_400(http, server, path, fields, param, words):
    body = chat(server, **fields) if path == CHAT else completion(server, **fields)
    refused = http.post(path, json=body)
    error = assert_openai_error(refused, 400, param)
    assert words in error["message"]
    assert "/project/" not in error["message"]  # no C++ source paths from xgrammar
    assert_still_serving(http, server, refused)


# -- unknown models and routes ----------------------------------------------------------


def test_unknown_model_and_route_are_404(http, server):
    refused = http.post(CHAT, json=chat(server, model="gpt-4"))
    error = assert_openai_error(refused, 404, "model")
    assert "gpt-4" in error["message"] and error["code"] == "model_not_found"
    assert_openai_error(http.post(COMPLETIONS, json=completion(server, model="gpt-4")), 404)
    assert_openai_error(http.post("/tokenize", json={"model": "gpt-4", "prompt": "Hi"}), 404)
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert_openai_error(http.post("/v1/no-such-route", json={"input": "hi"}), 404)
    refused = http.get(CHAT)
    assert_openai_error(refused, 405)
    assert refused.headers["allow"] == "POST"  # RFC 9110: a 405 names the methods allowed
    assert_still_serving(http, server, refused)


# -- a bug: a 500, and the connection lives on -------------------------------------------


class _BrokenTokenizer:
    chat_template = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in the tokenizer")

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0}


class _EngineWithABug:
    """Just enough of an EngineClient for /tokenize, whose tokenizer raises."""

    tokenizer = _BrokenTokenizer()
    max_model_len = 64
    is_alive = True
    core_stats = None
    request_metrics = RequestMetrics()


def test_an_unexpected_error_is_a_500_that_the_app_does_not_raise(caplog):
    """Starlette's last resort answers a 500 but raises the error on to uvicorn, which
    then drops the keep-alive connection; the app answers it and is done. httpx's ASGI
    transport raises whatever the app raises."""
    from serve.api.server import build_app
    from serve.api.settings import ServerSettings

    app = build_app(_EngineWithABug(), ServerSettings("tiny", "/nowhere"))

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/tokenize", json={"prompt": "Hi"})

    with caplog.at_level(logging.ERROR, logger="serve.api"):
        response = asyncio.run(call())
    error = assert_openai_error(response, 500)
    assert error["type"] == "internal_server_error" and "server log" in error["message"]
    (record,) = [r for r in caplog.records if "Internal error in request" in r.getMessage()]
    assert record.exc_info is not None and "a bug in the tokenizer" in str(record.exc_info[1])
