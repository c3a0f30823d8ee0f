"""POST /v1/messages (Anthropic's Messages API) through the official anthropic client.

The oracle is the chat endpoint: the same conversation, greedy, gives the same text and
token counts on both. This SDK sends no sampling fields of its own, so temperature goes
in `extra_body`. Tool use runs on the tiny model with a schema of enums, which the
grammar of a forced call keeps short.
"""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message
from api.conftest import scrape_metrics
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from serve.api.admission import Admission, AdmissionGate

GREEDY = {"temperature": 0}
SYSTEM = "Answer briefly."
QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": QUESTION}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "enum": ["Paris", "Rome"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": WEATHER_SCHEMA,
}
OPENAI_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": WEATHER_TOOL["description"],
        "parameters": WEATHER_SCHEMA,
    },
}
NAMED = {"type": "tool", "name": "get_weather"}
ANY_ONE = {"type": "any", "disable_parallel_tool_use": True}


def anthropic_client(server, api_key: str | None = "unused", **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.url, api_key=api_key, max_retries=0, timeout=60, **kwargs
    )


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def chat(server, messages, **kwargs):
    """The chat endpoint's greedy answer to `messages` (OpenAI's shape)."""
    return server.client().chat.completions.create(
        model=server.model, messages=messages, temperature=0, **kwargs
    )


def assert_anthropic_error(resp: httpx.Response, status: int, kind: str) -> str:
    """The status, and exactly Anthropic's error body; its message."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]["message"]


def sse_events(server, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """A streamed response's (event name, data) pairs, as sent."""
    events = []
    with httpx.stream(
        "POST", f"{server.url}/v1/messages", json={**body, "stream": True}, headers=headers
    ) as resp:
        assert resp.status_code == 200, resp.read()
        name = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
                name = None
    return events


def pick_stop(text: str) -> str:
    """Two ASCII letters or digits from past the text's start: a stop sequence that is sure
    to be whole characters (the tiny model's text is full of control bytes)."""
    match = re.search(r"[A-Za-z0-9]{2}", text[2:])
    assert match, f"no plain two-character run to stop on in {text!r}"
    return match.group()


# -- text ------------------------------------------------------------------------------


def test_greedy_message_equals_chat(server):
    client = anthropic_client(server)
    message = client.messages.create(
        model=server.model,
        system=SYSTEM,
        messages=MESSAGES,
        max_tokens=12,
        extra_body=GREEDY,
    )
    expected = chat(server, [{"role": "system", "content": SYSTEM}, *MESSAGES], max_tokens=12)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == server.model
    assert text_of(message) == expected.choices[0].message.content
    assert message.usage.input_tokens == expected.usage.prompt_tokens
    assert message.usage.output_tokens == expected.usage.completion_tokens
    assert expected.choices[0].finish_reason == "length"  # the tiny model rarely ends
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 12

    # Text blocks are the same conversation as strings.
    blocks = client.messages.create(
        model=server.model,
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        max_tokens=12,
        extra_body=GREEDY,
    )
    assert blocks.content == message.content
    counted = client.messages.count_tokens(model=server.model, system=SYSTEM, messages=MESSAGES)
    assert counted.input_tokens == message.usage.input_tokens


def test_stop_sequence(server):
    client = anthropic_client(server)
    kwargs = dict(model=server.model, messages=MESSAGES, max_tokens=16, extra_body=GREEDY)
    full = text_of(client.messages.create(**kwargs))
    stop = pick_stop(full)
    stopped = client.messages.create(**kwargs, stop_sequences=["no such text", stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert text_of(stopped) == full[: full.index(stop)]
    expected = chat(server, MESSAGES, max_tokens=16, stop=["no such text", stop])
    assert text_of(stopped) == expected.choices[0].message.content
    assert stopped.usage.output_tokens == expected.usage.completion_tokens
    empty = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": server.model, "messages": MESSAGES, "max_tokens": 4, "stop_sequences": [""]},
    )
    assert "stop_sequences" in assert_anthropic_error(empty, 400, "invalid_request_error")


def test_prefill_continues_the_assistant_text(server, tokenizer):
    """A final assistant message is continued, not answered: the prompt ends inside it."""
    client = anthropic_client(server)
    prefill = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    message = client.messages.create(
        model=server.model, messages=prefill, max_tokens=8, extra_body=GREEDY
    )
    expected = chat(
        server,
        prefill,
        max_tokens=8,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert text_of(message) == expected.choices[0].message.content
    prompt = tokenizer.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert prompt.endswith("The capital is")
    assert message.usage.input_tokens == len(tokenizer(prompt, add_special_tokens=False).input_ids)
    # On the chat endpoint (vLLM's extra), the generation prompt must be asked off.
    both = {"model": server.model, "messages": prefill, "continue_final_message": True}
    refused = httpx.post(f"{server.v1}/chat/completions", json=both)
    assert (
        refused.status_code == 400 and "add_generation_prompt" in refused.json()["error"]["message"]
    )


def test_stream_matches_the_message(server):
    client = anthropic_client(server)
    kwargs = dict(
        model=server.model, system=SYSTEM, messages=MESSAGES, max_tokens=12, extra_body=GREEDY
    )
    message = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == text_of(message)
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in message.content]
    assert (final.stop_reason, final.stop_sequence) == (message.stop_reason, None)
    assert final.usage.input_tokens == message.usage.input_tokens
    assert final.usage.output_tokens == message.usage.output_tokens
    assert final.id.startswith("msg_") and final.id != message.id

    events = sse_events(server, {**kwargs.pop("extra_body"), **kwargs})
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert re.fullmatch(
        r"message_start ping content_block_start (content_block_delta )+content_block_stop "
        r"message_delta message_stop",
        " ".join(names),
    ), names
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": message.usage.input_tokens, "output_tokens": 0}
    assert events[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {"output_tokens": message.usage.output_tokens}


def test_messages_feed_the_request_metrics(server):
    before = scrape_metrics(server)
    anthropic_client(server).messages.create(
        model=server.model, messages=MESSAGES, max_tokens=5, extra_body=GREEDY
    )
    after = scrape_metrics(server)
    finished = 'serve_request_success_total{finished_reason="length"}'
    assert after[finished] == before.get(finished, 0) + 1
    tokens = "serve_generation_tokens_total"
    assert after[tokens] == before.get(tokens, 0) + 5


# -- tool use --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tools_server(server_factory, tiny_model_factory):
    """test_tool_calling's hermes server: the tiny llama with room for the tools' system
    block (some 550 tokens of its tiny vocabulary)."""
    long_tiny_llama = tiny_model_factory("llama", max_position_embeddings=2048)
    return server_factory("--tool-call-parser", "hermes", model=long_tiny_llama)


@pytest.mark.parametrize("tool_choice", [NAMED, ANY_ONE], ids=["tool", "any"])
def test_forced_tool_use_and_its_result(tools_server, tool_choice):
    client = anthropic_client(tools_server)
    message = client.messages.create(
        model=tools_server.model,
        messages=MESSAGES,
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        max_tokens=200,
        extra_body=GREEDY,
    )
    assert message.stop_reason == "tool_use"
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_") and len(call.id) > len("toolu_")
    jsonschema.validate(call.input, WEATHER_SCHEMA)

    # The result goes back as a tool_result block; the chat endpoint, given the same turns
    # in OpenAI's form, answers the same.
    result = "22 degrees and sunny"
    answer = client.messages.create(
        model=tools_server.model,
        messages=[
            *MESSAGES,
            message.to_param(),
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}],
            },
        ],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "none"},
        max_tokens=8,
        extra_body=GREEDY,
    )
    openai_call = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.input)},
    }
    expected = chat(
        tools_server,
        [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [openai_call]},
            {"role": "tool", "tool_call_id": call.id, "content": result},
        ],
        tools=[OPENAI_WEATHER_TOOL],
        tool_choice="none",
        max_tokens=8,
    )
    assert text_of(answer) == expected.choices[0].message.content
    assert answer.usage.input_tokens == expected.usage.prompt_tokens
    assert answer.stop_reason == "max_tokens"


def test_tokens_counted_with_tools_need_no_parser(server_factory, long_context_model):
    """count_tokens samples nothing, so tools with the default choice ("auto") are counted
    on a server without --tool-call-parser, as they are with any other choice."""
    server = server_factory("--max-model-len", "4096", model=long_context_model)
    client = anthropic_client(server)
    count = client.messages.count_tokens
    kwargs = dict(model=server.model, messages=MESSAGES)
    with_tools = count(**kwargs, tools=[WEATHER_TOOL]).input_tokens
    assert (
        with_tools
        == count(**kwargs, tools=[WEATHER_TOOL], tool_choice={"type": "none"}).input_tokens
    )
    assert with_tools > count(**kwargs).input_tokens
    refused = httpx.post(
        f"{server.url}/v1/messages",
        json={**kwargs, "tools": [WEATHER_TOOL], "max_tokens": 4},
    )  # generating with "auto" still needs the parser
    assert "--tool-call-parser" in assert_anthropic_error(refused, 400, "invalid_request_error")


def test_streamed_tool_use_matches(tools_server):
    client = anthropic_client(tools_server)
    kwargs = dict(
        model=tools_server.model,
        messages=MESSAGES,
        tools=[WEATHER_TOOL],
        tool_choice=NAMED,
        max_tokens=200,
        extra_body=GREEDY,
    )
    message = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    (call,) = message.content
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(s.index, s.content_block.type, s.content_block.name) for s in starts] == [
        (0, "tool_use", "get_weather")
    ]
    assert starts[0].content_block.id.startswith("toolu_")
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(pieces) > 1  # the input arrives as it is written
    assert json.loads("".join(pieces)) == call.input
    assert final.stop_reason == "tool_use"
    (streamed,) = final.content
    assert (streamed.name, streamed.input) == (call.name, call.input)


def test_structured_output(server):
    client = anthropic_client(server)
    message = client.messages.create(
        model=server.model,
        messages=MESSAGES,
        output_config={"format": {"type": "json_schema", "schema": WEATHER_SCHEMA}},
        max_tokens=100,
        extra_body=GREEDY,
    )
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(message)), WEATHER_SCHEMA)


# -- errors ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deadline_server(server_factory, long_context_model):
    """test_timeouts' server: requests end after 0.5 s (--request-timeout)."""
    return server_factory(
        "--max-model-len",
        "4096",
        "--request-timeout",
        "0.5",
        "--grammar-compile-timeout",
        "0.001",
        model=long_context_model,
    )


def test_past_the_deadline_is_a_timeout_error(deadline_server):
    """A 504 before the response starts; once it has, an `error` event ends the stream."""
    hello = [{"role": "user", "content": "Hello!"}]  # greedy, this model never ends it
    body = {**GREEDY, "model": deadline_server.model, "messages": hello, "max_tokens": 4000}
    response = httpx.post(f"{deadline_server.url}/v1/messages", json=body, timeout=60)
    assert "--request-timeout" in assert_anthropic_error(response, 504, "timeout_error")
    events = sse_events(deadline_server, body)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert "content_block_delta" in names and "message_stop" not in names
    assert names[-1] == "error"
    error = events[-1][1]
    assert error["type"] == "error" and error["error"]["type"] == "timeout_error"


def test_invalid_requests_are_anthropic_errors(server):
    client = anthropic_client(server)
    base = {"model": server.model, "messages": MESSAGES, "max_tokens": 5}
    without_max_tokens = {k: v for k, v in base.items() if k != "max_tokens"}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", cast_to=Message, body=without_max_tokens)
    assert e.value.body["error"] == {
        "type": "invalid_request_error",
        "message": "max_tokens: Field required",
    }

    document = {"type": "document", "source": {"type": "text", "data": "A page."}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=server.model,
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, document]}],
            max_tokens=5,
        )
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "block 1 is of type 'document'" in e.value.body["error"]["message"]

    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus-4", messages=MESSAGES, max_tokens=5)
    assert e.value.body["error"]["type"] == "not_found_error"
    # A route under /v1/messages that serve lacks (Message Batches) answers in its shape too.
    batches = httpx.post(f"{server.url}/v1/messages/batches", json={"requests": []})
    assert "/v1/messages/batches" in assert_anthropic_error(batches, 404, "not_found_error")

    url = f"{server.url}/v1/messages"
    refused = {
        # Accepted (not enforced) as vLLM's, with its check: below max_tokens.
        "budget_tokens must be less than max_tokens": {
            **base,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        },
        "web_search_20250305": {
            **base,
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        },
        "temperature": {**base, "temperature": 1.5},
        "--tool-call-parser": {**base, "tools": [WEATHER_TOOL]},  # "auto", on this server
        "not among the tools": {
            **base,
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "tool", "name": "x"},
        },
        "maximum context length": {**base, "max_tokens": 10_000},
        "block 0 is of type 'document'": {
            **base,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [{"type": "document"}],
                        }
                    ],
                }
            ],
        },
    }
    for named, body in refused.items():
        message = assert_anthropic_error(httpx.post(url, json=body), 400, "invalid_request_error")
        assert named in message
    # A malformed body, and one that is not JSON, are Anthropic's errors on this path too.
    assert_anthropic_error(httpx.post(url, content=b"{"), 400, "invalid_request_error")
    assert_anthropic_error(
        httpx.post(url, content=b"{}", headers={"Content-Type": "text/plain"}),
        415,
        "invalid_request_error",
    )
    count_url = f"{server.url}/v1/messages/count_tokens"
    assert_anthropic_error(
        httpx.post(count_url, json={"model": server.model}), 400, "invalid_request_error"
    )
    # Serving on (greedy: a sampled end of turn could end it short).
    assert client.messages.create(**base, extra_body=GREEDY).usage.output_tokens == 5


def test_api_key_by_x_api_key_or_bearer(server_factory):
    """test_errors' keyed server: the key goes as `x-api-key` or `Authorization: Bearer`."""
    server = server_factory("--api-key", "secret", "--served-model-name", "tiny")
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=3, extra_body=GREEDY)
    for client in (
        anthropic_client(server, api_key=None, default_headers={"x-api-key": "wrong"}),
        anthropic_client(server, api_key="wrong"),
    ):
        with pytest.raises(anthropic.AuthenticationError) as e:
            client.messages.create(**kwargs)
        assert e.value.body == {
            "type": "error",
            "error": {"type": "authentication_error", "message": e.value.body["error"]["message"]},
        }
        assert "x-api-key" in e.value.body["error"]["message"]
    body = {**kwargs, "model": "tiny"}
    missing = httpx.post(f"{server.url}/v1/messages", json=body)
    assert "x-api-key" in assert_anthropic_error(missing, 401, "authentication_error")
    for client in (
        anthropic_client(server, api_key=None, default_headers={"x-api-key": "secret"}),
        anthropic_client(server, api_key="secret"),
    ):
        assert client.messages.create(**kwargs).usage.output_tokens == 3
    # The same header opens the OpenAI paths; their refusals keep OpenAI's shape.
    models = httpx.get(f"{server.v1}/models", headers={"x-api-key": "secret"})
    assert models.json()["data"][0]["id"] == "tiny"
    refused = httpx.get(f"{server.v1}/models", headers={"x-api-key": "wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert set(refused.json()) == {"error"}


def test_admission_refusals_take_the_path_shape():
    """A full queue and a body over the cap are refused before any route: in Anthropic's
    shape on its paths, OpenAI's on the others."""

    async def ok(scope, receive, send):
        await PlainTextResponse("ok")(scope, receive, send)

    full = TestClient(AdmissionGate(Starlette(), Admission(max_generating=0)))
    message = assert_anthropic_error(full.post("/v1/messages", json={}), 503, "overloaded_error")
    assert "--max-num-queued-requests" in message
    openai = full.post("/v1/chat/completions", json={})
    assert openai.status_code == 503 and set(openai.json()) == {"error"}

    capped = TestClient(AdmissionGate(ok, Admission(max_body_bytes=10)))
    assert_anthropic_error(capped.post("/v1/messages", content=b"x" * 11), 413, "request_too_large")
    assert capped.post("/v1/messages", content=b"x" * 10).text == "ok"


def test_models_in_anthropics_shape_for_its_sdk(server):
    client = anthropic_client(server)
    (model,) = client.models.list().data
    assert model.type == "model" and model.id == server.model
    assert model.display_name == server.model and model.created_at.year >= 2025
    assert client.models.retrieve(server.model).id == server.model
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["type"] == "error"  # Anthropic's shape, which its SDK reads
    assert client.models.list(limit=1, after_id=server.model).data == []
    # The OpenAI shape stays for everyone else.
    assert httpx.get(f"{server.v1}/models", timeout=30).json()["object"] == "list"
