"""Tool calling on /v1/chat/completions through the openai client, streamed and not.

tool_choice "required" and named functions are checked on the default model (`slow`):
their output is constrained to a JSON schema, so its arguments must validate against the
tool's parameters. tool_choice "auto" needs `--tool-call-parser`; on the tiny model a
`guided_choice` of one exact text stands in for a model that writes a call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
import jsonschema
import pytest

PARAMETERS = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["location", "unit"],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": PARAMETERS,
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "The current time in a city."},
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARGS = {"location": "Paris", "unit": "celsius"}
HERMES_CALL = f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': ARGS})}\n</tool_call>"


@dataclass
class Choice:
    """A choice as a client sees it, from a response or from accumulated stream chunks."""

    content: str | None
    calls: list[dict] = field(default_factory=list)  # {"id", "name", "arguments"}
    finish_reason: str | None = None


def from_response(resp) -> list[Choice]:
    return [
        Choice(
            c.message.content,
            [
                {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                for t in c.message.tool_calls or []
            ],
            c.finish_reason,
        )
        for c in resp.choices
    ]


def from_stream(chunks) -> list[Choice]:
    """Accumulate deltas as OpenAI's clients do, checking the tool-call delta shape: a
    call's first delta has id, type and name, later ones only argument fragments."""
    choices: dict[int, Choice] = {}
    for chunk in chunks:
        for c in chunk.choices:
            choice = choices.setdefault(c.index, Choice(None))
            if c.delta.content:
                choice.content = (choice.content or "") + c.delta.content
            for delta in c.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index == len(choice.calls), "calls open in order"
                    assert delta.type == "function" and delta.function.name
                    choice.calls.append({"id": delta.id, "name": delta.function.name})
                    choice.calls[-1]["arguments"] = delta.function.arguments or ""
                else:
                    assert delta.index == len(choice.calls) - 1 and not delta.function.name
                    choice.calls[delta.index]["arguments"] += delta.function.arguments
            if c.finish_reason is not None:
                assert choice.finish_reason is None, "one finish chunk per choice"
                choice.finish_reason = c.finish_reason
    return [choices[i] for i in sorted(choices)]


def create(client, server, stream: bool, **kwargs) -> list[Choice]:
    kwargs = {"model": server.model, "temperature": 0, **kwargs}
    if stream:
        return from_stream(client.chat.completions.create(**kwargs, stream=True))
    return from_response(client.chat.completions.create(**kwargs))


def assert_weather_call(call: dict) -> None:
    assert call["name"] == "get_weather"
    assert call["id"].startswith("call_") and len(call["id"]) > len("call_")
    jsonschema.validate(json.loads(call["arguments"]), PARAMETERS)


# --- the default model: forced choices, auto without a call, multi-turn -------------------


@pytest.fixture(scope="module")
def default_server(server_factory):
    return server_factory("--tool-call-parser", "hermes", model=None)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_choice_gives_a_valid_call(default_server, stream, tool_choice):
    kwargs = dict(
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=tool_choice,
        max_tokens=80,
    )
    if tool_choice == "required":
        kwargs["parallel_tool_calls"] = False  # greedy decoding would repeat calls
    (choice,) = create(default_server.client(), default_server, stream, **kwargs)
    # OpenAI's and vLLM's: "tool_calls" when the model chose to call, "stop" when named.
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    assert not choice.content
    (call,) = choice.calls
    assert_weather_call(call)


@pytest.mark.slow
def test_streamed_forced_call_matches_the_response(default_server):
    client = default_server.client()
    for tool_choice in ("required", NAMED):
        kwargs = dict(
            messages=WEATHER_QUESTION,
            tools=[WEATHER_TOOL],
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            max_tokens=80,
        )
        (full,) = create(client, default_server, False, **kwargs)
        (streamed,) = create(client, default_server, True, **kwargs)
        assert [(c["name"], c["arguments"]) for c in streamed.calls] == [
            (c["name"], c["arguments"]) for c in full.calls
        ]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_auto_without_a_call_is_content(default_server, stream):
    (choice,) = create(
        default_server.client(),
        default_server,
        stream,
        messages=[{"role": "user", "content": "What is 2+2?"}],
        tools=[WEATHER_TOOL],
        max_tokens=40,
    )
    assert choice.calls == [] and choice.content
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_multi_turn_with_a_tool_result(default_server, stream):
    messages = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc123",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(ARGS)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc123", "content": '{"temperature": 22}'},
    ]
    (choice,) = create(
        default_server.client(),
        default_server,
        stream,
        messages=messages,
        tools=[WEATHER_TOOL],
        max_tokens=30,
    )
    assert choice.content and choice.finish_reason in ("stop", "length")


# --- the tiny model: auto through the parsers, none, n > 1 --------------------------------


@pytest.fixture(scope="module")
def long_tiny_llama(tiny_model_factory):
    """The tiny llama with room for the tools' system block: its tiny vocabulary spends
    some 550 tokens on the hermes one, past the usual 512."""
    return tiny_model_factory("llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def hermes_server(server_factory, long_tiny_llama):
    return server_factory("--tool-call-parser", "hermes", model=long_tiny_llama)


def test_auto_on_random_text_is_content(hermes_server):
    kwargs = dict(messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], max_tokens=12, n=2, seed=3)
    client = hermes_server.client()
    full = create(client, hermes_server, False, **kwargs)
    streamed = create(client, hermes_server, True, **kwargs)
    assert full == streamed
    for choice in full:
        assert choice.calls == [] and choice.content
        assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_auto_reads_hermes_calls(hermes_server, stream):
    second = f"<tool_call>\n{json.dumps({'name': 'get_time', 'arguments': {}})}\n</tool_call>"
    output = f"Checking.\n{HERMES_CALL}\n{second}"
    choices = create(
        hermes_server.client(),
        hermes_server,
        stream,
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL, TIME_TOOL],
        max_tokens=200,
        n=2,
        temperature=1.0,
        extra_body={"guided_choice": [output]},  # the tiny model writes exactly this
    )
    assert len(choices) == 2
    for choice in choices:
        assert choice.content == "Checking."
        weather, time = choice.calls
        assert_weather_call(weather)
        assert json.loads(weather["arguments"]) == ARGS
        assert (time["name"], json.loads(time["arguments"])) == ("get_time", {})
        assert choice.finish_reason == "tool_calls"
    assert len({call["id"] for c in choices for call in c.calls}) == 4


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_auto_without_parallel_calls_keeps_the_first(hermes_server, stream):
    """parallel_tool_calls false: at most one call a turn (OpenAI's rule; vLLM keeps the
    first of those the model wrote)."""
    second = f"<tool_call>\n{json.dumps({'name': 'get_time', 'arguments': {}})}\n</tool_call>"
    (choice,) = create(
        hermes_server.client(),
        hermes_server,
        stream,
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL, TIME_TOOL],
        parallel_tool_calls=False,
        max_tokens=200,
        extra_body={"guided_choice": [f"Checking.\n{HERMES_CALL}\n{second}"]},
    )
    (weather,) = choice.calls
    assert_weather_call(weather)
    assert choice.content == "Checking." and choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_choice_none_does_not_parse(hermes_server, stream):
    (choice,) = create(
        hermes_server.client(),
        hermes_server,
        stream,
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_tokens=200,
        extra_body={"guided_choice": [HERMES_CALL]},
    )
    assert choice.content == HERMES_CALL and choice.calls == []
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_auto_reads_llama3_json_calls(server_factory, long_tiny_llama, stream):
    server = server_factory("--tool-call-parser", "llama3_json", model=long_tiny_llama)
    output = json.dumps({"name": "get_weather", "parameters": ARGS})
    (choice,) = create(
        server.client(),
        server,
        stream,
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL],
        max_tokens=200,
        extra_body={"guided_choice": [output]},
    )
    assert choice.content is None and choice.finish_reason == "tool_calls"
    (call,) = choice.calls
    assert_weather_call(call)


def test_multi_turn_renders_on_a_template_without_tools(hermes_server, tokenizer):
    """The tiny model's ChatML knows no tools: the call is written into the assistant's
    text in the hermes format, and the prompt counts the tools' system block."""
    messages = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(ARGS)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22"},
    ]
    text = tokenizer.apply_chat_template(
        [*WEATHER_QUESTION, {"role": "assistant", "content": HERMES_CALL}, messages[2]],
        tokenize=False,
        add_generation_prompt=True,
    )
    rendered = tokenizer(text, add_special_tokens=False).input_ids
    body = {
        "model": hermes_server.model,
        "messages": messages,
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
    }
    with httpx.Client(base_url=hermes_server.url, timeout=60) as http:
        plain = http.post("/v1/chat/completions", json=body)
        with_tools = http.post(
            "/v1/chat/completions", json={**body, "tools": [WEATHER_TOOL], "tool_choice": "none"}
        )
        # The same greedy continuation of the expected rendering, given as token ids.
        expected = http.post(
            "/v1/completions",
            json={
                "model": hermes_server.model,
                "prompt": rendered,
                "max_tokens": 3,
                "temperature": 0,
                "logprobs": 0,
            },
        )
    assert plain.status_code == 200, plain.text
    assert with_tools.status_code == 200, with_tools.text
    assert expected.status_code == 200, expected.text
    num_plain = plain.json()["usage"]["prompt_tokens"]
    assert num_plain == len(rendered)
    assert with_tools.json()["usage"]["prompt_tokens"] > num_plain + 50  # the tools' block
    # The model answered that very prompt: its reply, and the logprob of every token of
    # it, are those of the completion of the rendering.
    answer, completion = plain.json()["choices"][0], expected.json()["choices"][0]
    assert answer["message"]["content"] and answer["message"]["content"] == completion["text"]
    logprobs = [entry["logprob"] for entry in answer["logprobs"]["content"]]
    assert logprobs == pytest.approx(completion["logprobs"]["token_logprobs"], abs=1e-5)


# --- requests the server refuses ------------------------------------------------------------


def assert_400(resp, param: str | None, *words: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for word in words:
        assert word in error["message"], error


STRING_FUNCTION = {"name": "f", "parameters": {"type": "string"}}
UNIQUE_IDS = {
    "type": "object",
    "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
}
UNIQUE_IDS_TOOL = {"type": "function", "function": {"name": "f", "parameters": UNIQUE_IDS}}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [WEATHER_TOOL]}, "tool_choice", ["--tool-call-parser", "hermes"]),
        ({"tools": [WEATHER_TOOL], "tool_choice": "auto"}, "tool_choice", ["hermes"]),
        ({"tool_choice": "required"}, "tool_choice", ["tools"]),
        ({"tool_choice": NAMED}, "tool_choice", ["tools"]),
        (
            {"tools": [TIME_TOOL], "tool_choice": NAMED},
            "tool_choice",
            ["get_weather", "get_time"],
        ),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools", ["unique", "get_weather"]),
        ({"tools": []}, "tools", ["empty array"]),
        ({"tools": [], "tool_choice": "none"}, "tools", ["empty array"]),
        (
            {"tools": [{"type": "function", "function": STRING_FUNCTION}]},
            "tools.0.function.parameters",
            ["object"],
        ),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
            ["response_format"],
        ),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": NAMED, "guided_regex": "a+"},
            "tool_choice",
            ["guided_regex"],
        ),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": NAMED, "structured_outputs": {"regex": "a"}},
            "tool_choice",
            ["structured_outputs"],
        ),
        (
            {"tools": [WEATHER_TOOL, UNIQUE_IDS_TOOL], "tool_choice": "required"},
            "tool_choice",
            ["tools.1.function.parameters", "`uniqueItems` at /properties/ids", "xgrammar"],
        ),
        (
            {"messages": [{"role": "tool", "content": "22"}]},
            "messages.0",
            ["tool_call_id"],
        ),
    ],
    ids=[
        "auto-without-parser",
        "explicit-auto-without-parser",
        "required-without-tools",
        "named-without-tools",
        "named-not-in-tools",
        "duplicate-names",
        "empty-tools",
        "empty-tools-choice-none",
        "parameters-not-object",
        "required-and-response-format",
        "named-and-guided",
        "named-and-structured-outputs",
        "required-parameters-not-enforceable",
        "tool-message-without-id",
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_bad_tool_requests_are_400(server, http, fields, param, words, stream):
    body = {"model": server.model, "messages": WEATHER_QUESTION, "max_tokens": 2, **fields}
    assert_400(http.post("/v1/chat/completions", json={**body, "stream": stream}), param, *words)


UNIT_PARAMETERS = {
    "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["unit"],
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("tool_choice", ["required", "named"])
@pytest.mark.parametrize("typed", [True, False], ids=["typed", "untyped"])
def test_forced_call_finish_reason(client, server, stream, tool_choice, typed):
    """The tiny model, held to the call's schema: a named function's call ends with "stop",
    a call tool_choice "required" made with "tool_calls" (OpenAI's and vLLM's rule).
    Parameters written without "type" are an object's, as vLLM reads them."""
    parameters = {"type": "object", **UNIT_PARAMETERS} if typed else UNIT_PARAMETERS
    tool = {"type": "function", "function": {"name": "set_unit", "parameters": parameters}}
    named = {"type": "function", "function": {"name": "set_unit"}}
    (choice,) = create(
        client,
        server,
        stream,
        messages=WEATHER_QUESTION,
        tools=[tool],
        tool_choice=named if tool_choice == "named" else "required",
        parallel_tool_calls=False,
        max_tokens=100,  # the tools' block fills some 390 of the tiny model's 512
    )
    (call,) = choice.calls
    assert call["name"] == "set_unit"
    jsonschema.validate(json.loads(call["arguments"]), {"type": "object", **UNIT_PARAMETERS})
    assert choice.finish_reason == ("stop" if tool_choice == "named" else "tool_calls")


def test_required_call_cut_short_by_max_tokens(client, server):
    """Out of tokens inside the array, tool_choice "required" gives the call written so
    far, its arguments cut short, streamed alike (never the array's text as content), and
    finishes with "length". Sent back in the history (the cookbook's pattern), that call is
    taken, as OpenAI takes any arguments text, and rendered with empty arguments."""
    tool = {"type": "function", "function": {"name": "set_unit", "parameters": UNIT_PARAMETERS}}
    # One call (the schema allows one), greedy as `create` asks below: the cut runs must
    # write this call's first tokens. (A sampled call depended on what the shared server's
    # random stream had served before, and made two calls after some test orders.)
    kwargs = dict(
        messages=WEATHER_QUESTION, tools=[tool], tool_choice="required", parallel_tool_calls=False
    )
    full = client.chat.completions.create(
        model=server.model, **kwargs, max_tokens=100, temperature=0
    )
    (whole,) = full.choices[0].message.tool_calls
    cut = full.usage.completion_tokens - 8  # inside the arguments: `celsius"}}]` is left
    for stream in (False, True):
        (choice,) = create(client, server, stream, **kwargs, max_tokens=cut)
        assert choice.finish_reason == "length" and not choice.content
        (call,) = choice.calls
        assert call["name"] == "set_unit" and call["id"].startswith("call_")
        assert whole.function.arguments.startswith(call["arguments"])
        assert 0 < len(call["arguments"]) < len(whole.function.arguments)

    def prompt_ids(arguments: str) -> list[int]:
        function = {"name": "set_unit", "arguments": arguments}
        history = [
            *WEATHER_QUESTION,
            {"role": "assistant", "tool_calls": [{"id": call["id"], "function": function}]},
            {"role": "tool", "tool_call_id": call["id"], "content": "unit unknown"},
        ]
        resp = client.chat.completions.create(
            model=server.model,
            messages=history,
            tools=[tool],
            tool_choice="none",
            max_tokens=1,
            extra_body={"return_token_ids": True},
        )
        return resp.prompt_token_ids

    assert prompt_ids(call["arguments"]) == prompt_ids("")


def test_tool_choice_none_needs_no_parser(client, server):
    resp = client.chat.completions.create(
        model=server.model,
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_tokens=3,
    )
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].finish_reason in ("stop", "length")
