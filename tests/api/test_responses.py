"""POST /v1/responses, GET and DELETE /v1/responses/{id}, through the official openai
client: a response is the chat completion of the same conversation, streamed as the SDK's
helpers read it, continued by previous_response_id, with structured output and forced
function calls; what the server cannot do is a 400 that names it."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from api.conftest import scrape_metrics, wait_until_idle
from api.openai_errors import assert_openai_error
from api.test_chat import pick_stop
from openai.types.responses import Response

from serve.chat.tool_parsers.base import load_json

QUESTION = "What is the capital of France?"
INSTRUCTIONS = "Answer in one word."
GREEDY = {"temperature": 0}
IGNORE_EOS = {"ignore_eos": True}
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Madrid"]},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "enum": ["Paris", "Rome"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
CHAT_WEATHER_FUNCTION = {k: v for k, v in WEATHER_TOOL.items() if k != "type"}
FORCE_WEATHER = {"type": "function", "name": "get_weather"}
TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def raw_response(server, **body) -> Response:
    """POST the body and validate the JSON against the SDK's own type, strictly."""
    reply = httpx.post(f"{server.v1}/responses", json={"model": server.model, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return Response.model_validate(reply.json())


def sse_events(server, body: dict) -> list[dict]:
    """A streamed response's events, as JSON, checking each `event:` line names its type."""
    body = {"model": server.model, **body, "stream": True}
    with httpx.stream("POST", f"{server.v1}/responses", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    events = [
        json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")
    ]
    assert names == [event["type"] for event in events]
    return events


def collapse(types: list[str]) -> list[str]:
    """Event types with runs of the same delta type counted once."""
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1] or "delta" not in t]


# --- plain text: the chat completion of the same conversation ------------------------------


def test_a_response_is_the_chat_completion_of_its_conversation(client, server):
    resp = client.responses.create(
        model=server.model,
        input=QUESTION,
        instructions=INSTRUCTIONS,
        max_output_tokens=12,
        **GREEDY,
    )
    chat = client.chat.completions.create(
        model=server.model,
        messages=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=12,
        **GREEDY,
    )
    (choice,) = chat.choices
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.model == server.model and resp.instructions == INSTRUCTIONS
    assert resp.output_text == choice.message.content and resp.output_text
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == chat.usage.total_tokens
    expected_status = "incomplete" if choice.finish_reason == "length" else "completed"
    assert resp.status == message.status == expected_status


def test_message_items_with_text_parts_read_as_the_string_input(client, server):
    as_text = client.responses.create(
        model=server.model, input=QUESTION, max_output_tokens=8, **GREEDY
    )
    parts = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    as_items = raw_response(server, input=parts, max_output_tokens=8, **GREEDY)
    assert as_items.output_text == as_text.output_text
    assert as_items.usage.input_tokens == as_text.usage.input_tokens


def test_max_output_tokens_makes_it_incomplete(server):
    unknown = {"a_field_no_server_knows": {"x": 1}}  # ignored, as on the other endpoints
    resp = raw_response(server, input=QUESTION, max_output_tokens=5, **IGNORE_EOS, **unknown)
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 5 and resp.max_output_tokens == 5
    assert resp.output[0].status == "incomplete"
    assert 0 <= resp.usage.input_tokens_details.cached_tokens < resp.usage.input_tokens
    assert resp.usage.output_tokens_details.reasoning_tokens == 0


def test_logprobs_come_with_the_output_text(client, server):
    resp = raw_response(
        server,
        input=QUESTION,
        max_output_tokens=6,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
        **IGNORE_EOS,
        **GREEDY,
    )
    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        extra_body=IGNORE_EOS,
        **GREEDY,
    )
    logprobs = resp.output[0].content[0].logprobs
    expected = chat.choices[0].logprobs.content
    assert len(logprobs) == len(expected) == 6
    for entry, want in zip(logprobs, expected):
        assert (entry.token, entry.bytes) == (want.token, want.bytes)
        assert entry.logprob == pytest.approx(want.logprob)
        assert [t.token for t in entry.top_logprobs] == [t.token for t in want.top_logprobs]
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy


# --- streaming: the SDK's helpers ---------------------------------------------------------


def test_the_stream_helper_builds_the_same_response(client, server):
    probe = client.responses.create(
        model=server.model, input=QUESTION, max_output_tokens=16, extra_body=IGNORE_EOS, **GREEDY
    )
    stop = pick_stop(probe.output_text)  # so that it completes, which the helper needs
    kwargs = dict(model=server.model, input=QUESTION, max_output_tokens=16, **GREEDY)
    full = client.responses.create(**kwargs, extra_body={"stop": stop})
    assert full.status == "completed" and full.output_text == probe.output_text.split(stop)[0]
    with client.responses.stream(**kwargs, extra_body={"stop": stop}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    assert collapse(types) == [
        "response.created",
        "response.in_progress",
        *TEXT_EVENTS,
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == full.output_text
    assert final.status == "completed" and final.output_text == full.output_text
    assert final.usage.input_tokens == full.usage.input_tokens
    assert final.usage.output_tokens == full.usage.output_tokens
    assert len({event.response.id for event in events if hasattr(event, "response")}) == 1
    # Stored before the last event: retrievable as it ended.
    assert client.responses.retrieve(final.id).output_text == full.output_text


def test_a_stream_cut_short_ends_incomplete(client, server):
    stream = client.responses.create(
        model=server.model,
        input=QUESTION,
        max_output_tokens=4,
        stream=True,
        extra_body=IGNORE_EOS,
    )
    events = list(stream)
    assert events[-1].type == "response.incomplete"
    last = events[-1].response
    assert last.incomplete_details.reason == "max_output_tokens"
    assert last.usage.output_tokens == 4 and last.output[0].status == "incomplete"
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == last.output_text


# --- structured output --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_json_schema_format_gives_valid_json(client, server, stream):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    kwargs = dict(model=server.model, input="Which city, and is it sunny?", text={"format": fmt})
    if stream:
        with client.responses.stream(**kwargs, temperature=1.0) as events:
            resp = events.get_final_response()
    else:
        resp = client.responses.create(**kwargs, temperature=1.0)
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), CITY)
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "city"


def test_a_bad_schema_is_a_400_naming_text_format(server):
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object", "minProperties": "x"}}
    reply = httpx.post(
        f"{server.v1}/responses", json={"input": "Hi", "text": {"format": fmt}}, timeout=30
    )
    assert_openai_error(reply, 400, "text.format")


# --- continuing a conversation ------------------------------------------------------------


def count_tokens(server, messages) -> int:
    reply = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30)
    return reply.json()["count"]


def test_previous_response_id_continues_the_conversation(client, server):
    kwargs = dict(model=server.model, max_output_tokens=8, extra_body=IGNORE_EOS, **GREEDY)
    first = client.responses.create(input="Hello!", instructions=INSTRUCTIONS, **kwargs)
    second = client.responses.create(input="Tell me more.", previous_response_id=first.id, **kwargs)
    # Instructions are not carried over; the first turn's input and output are.
    conversation = [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Tell me more."},
    ]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == count_tokens(server, conversation)
    one_shot = client.responses.create(input=conversation, store=False, **kwargs)
    assert second.output_text == one_shot.output_text
    assert second.usage.input_tokens == one_shot.usage.input_tokens
    third = client.responses.create(input="And then?", previous_response_id=second.id, **kwargs)
    longer = [*conversation, {"role": "assistant", "content": second.output_text}]
    longer.append({"role": "user", "content": "And then?"})
    assert third.usage.input_tokens == count_tokens(server, longer)


def test_reasoning_settings_and_items_are_taken_without_a_parser(client, server):
    """vLLM 0.32 takes `reasoning` whatever its parser (the effort reaches the template),
    and reasoning items sent back, which join the assistant turn they start."""
    thinking = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text"}]}
    thinking["content"][0]["text"] = "They greet me."
    turns = [
        {"role": "user", "content": "Hello!"},
        thinking,
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bye."},
    ]
    resp = raw_response(
        server, input=turns, max_output_tokens=2, reasoning={"effort": "low", "summary": "auto"}
    )
    assert (resp.reasoning.effort, resp.reasoning.summary) == ("low", "auto")
    listed = client.responses.input_items.list(resp.id, order="asc").data
    assert [item.type for item in listed] == ["message", "reasoning", "message", "message"]
    assert listed[1].content[0].text == "They greet me."

    from serve.api.protocol_responses import ResponsesRequest
    from serve.api.responses_items import chat_messages

    items = ResponsesRequest.model_validate({"input": turns}).input_items
    assert chat_messages(None, items)[1] == {
        "role": "assistant",
        "content": "Hi.",
        "reasoning": "They greet me.",
    }


def test_input_items_list_the_chain_newest_first_through_the_sdk(client, server):
    kwargs = dict(model=server.model, max_output_tokens=4, extra_body=IGNORE_EOS, **GREEDY)
    first = client.responses.create(input="Hello!", instructions=INSTRUCTIONS, **kwargs)
    follow_up = [
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me more."}]},
        {"role": "user", "content": "Briefly.", "id": "msg_mine"},  # kept, as OpenAI keeps it
    ]
    second = client.responses.create(input=follow_up, previous_response_id=first.id, **kwargs)
    listed = client.responses.input_items.list(second.id).data
    # Newest first: this turn's two inputs, the first turn's output, then its input (the
    # instructions are no item).
    assert [item.type for item in listed] == ["message"] * 4
    assert [item.role for item in listed] == ["user", "user", "assistant", "user"]
    texts = [item.content[0].text for item in listed]
    assert texts == ["Briefly.", "Tell me more.", first.output_text, "Hello!"]
    assert listed[2].id == first.output[0].id  # an output keeps its id
    assert listed[0].id == "msg_mine"
    assert len({item.id for item in listed}) == 4
    oldest = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [item.content[0].text for item in oldest.data] == ["Hello!", first.output_text]
    assert oldest.has_more and oldest.last_id == listed[2].id
    rest = client.responses.input_items.list(second.id, order="asc", after=oldest.last_id)
    assert [item.content[0].text for item in rest.data] == ["Tell me more.", "Briefly."]
    assert not rest.has_more
    assert client.responses.input_items.list(first.id).data[0].content[0].text == "Hello!"
    for query, param in (("limit=0", "limit"), ("order=sideways", "order")):
        reply = httpx.get(f"{server.v1}/responses/{second.id}/input_items?{query}", timeout=30)
        assert_openai_error(reply, 400, param)
    missing = httpx.get(f"{server.v1}/responses/resp_unknown/input_items", timeout=30)
    assert_openai_error(missing, 404, "response_id")


def test_retrieve_and_delete(client, server):
    resp = client.responses.create(
        model=server.model, input="Hello!", max_output_tokens=4, metadata={"topic": "greeting"}
    )
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text
    assert got.usage == resp.usage and got.metadata == {"topic": "greeting"}
    reply = httpx.delete(f"{server.v1}/responses/{resp.id}", timeout=30)
    assert reply.json() == {"id": resp.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)
    reply = httpx.post(
        f"{server.v1}/responses",
        json={"input": "Go on.", "previous_response_id": resp.id},
        timeout=30,
    )
    assert_openai_error(reply, 404, "previous_response_id")


def test_unknown_and_unstored_ids_are_404s(client, server):
    for method in ("GET", "DELETE"):
        reply = httpx.request(method, f"{server.v1}/responses/resp_unknown", timeout=30)
        error = assert_openai_error(reply, 404, "response_id")
        assert "resp_unknown" in error["message"]
    unstored = client.responses.create(
        model=server.model, input="Hello!", max_output_tokens=2, store=False
    )
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


# --- what is refused ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.0.content",
            "input_file",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input.0.content.0",
            "Files API",
        ),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"input": "Hi", "tools": [{"type": "file_search"}]}, "tools", "file_search"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
        ({"input": "Hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web"),
        ({"input": "Hi", "background": True}, "background", "background"),
        ({"input": "Hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort", "high"),
        (
            {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
            "input.0.encrypted_content",
            "encrypted",
        ),
        ({"input": "Hi", "truncation": "auto"}, "truncation", "auto"),
        ({"input": "Hi", "conversation": "conv_1"}, "conversation", "conversations"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "input",
            "call_x",
        ),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "call_y", "name": "f", "arguments": "{"}
                ]
            },
            "input",
            "No tool output found for function call call_y.",
        ),
        ({"input": "Hi", "max_output_tokens": 100000}, "max_output_tokens", "context length"),
        ({"input": "Hi", "top_logprobs": 50}, "top_logprobs", "top_logprobs"),
        ({"input": []}, "input", "empty"),
    ],
)
def test_what_it_cannot_do_is_a_400_naming_it(server, body, param, named):
    reply = httpx.post(f"{server.v1}/responses", json=body, timeout=30)
    error = assert_openai_error(reply, 400, param)
    assert named in error["message"]


def test_tools_without_a_parser_need_a_forced_choice(server):
    reply = httpx.post(
        f"{server.v1}/responses", json={"input": "Hi", "tools": [WEATHER_TOOL]}, timeout=30
    )
    assert "--tool-call-parser" in assert_openai_error(reply, 400, "tool_choice")["message"]


def test_responses_feed_the_request_metrics(server):
    before = wait_until_idle(server)
    raw_response(server, input="Hello!", max_output_tokens=3, **IGNORE_EOS)
    after = wait_until_idle(server)
    e2e = "serve_e2e_request_latency_seconds_count"
    assert after[e2e] - before[e2e] == 1
    assert after["serve_generation_tokens_total"] - before["serve_generation_tokens_total"] == 3
    length = 'serve_request_success_total{finished_reason="length"}'
    assert after[length] - before.get(length, 0) == 1
    ok = 'serve_http_responses_total{status="200"}'
    assert scrape_metrics(server)[ok] > before.get(ok, 0)
    assert after["serve_kv_cache_blocks_used"] == 0


# --- function calls: the tiny model with room for the tools' system block -----------------


@pytest.fixture(scope="module")
def tool_server(server_factory, tiny_model_factory):
    """test_tool_calling's hermes server: a context long enough for the tools' prompt."""
    model = tiny_model_factory("llama", max_position_embeddings=2048)
    return server_factory("--tool-call-parser", "hermes", model=model)


def forced_call(client, server, max_output_tokens=60, **kwargs):
    return client.responses.create(
        model=server.model,
        input="What is the weather like in Paris?",
        tools=[WEATHER_TOOL],
        tool_choice=FORCE_WEATHER,
        max_output_tokens=max_output_tokens,
        **GREEDY,
        **kwargs,
    )


def test_a_forced_function_call_and_its_continuation(tool_server):
    client = tool_server.client()
    resp = forced_call(client, tool_server)
    assert resp.status == "completed"
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    assert resp.tool_choice.name == "get_weather" and resp.tools[0].name == "get_weather"

    answer = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 22}'}
    kwargs = dict(model=tool_server.model, tools=[WEATHER_TOOL], max_output_tokens=8, **GREEDY)
    continued = client.responses.create(
        previous_response_id=resp.id, input=[answer], extra_body=IGNORE_EOS, **kwargs
    )
    assert continued.output[0].type == "message" and continued.output_text
    # The same turn as a chat completion: the call and its result as messages.
    chat = client.chat.completions.create(
        model=tool_server.model,
        messages=[
            {"role": "user", "content": "What is the weather like in Paris?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 22}'},
        ],
        tools=[{"type": "function", "function": CHAT_WEATHER_FUNCTION}],
        max_tokens=8,
        extra_body=IGNORE_EOS,
        **GREEDY,
    )
    assert continued.output_text == chat.choices[0].message.content
    assert continued.usage.input_tokens == chat.usage.prompt_tokens
    # Sending the output items back by hand is the same conversation.
    by_hand = client.responses.create(
        input=[
            {"role": "user", "content": "What is the weather like in Paris?"},
            call.model_dump(exclude_none=True),
            answer,
        ],
        store=False,
        extra_body=IGNORE_EOS,
        **kwargs,
    )
    assert by_hand.output_text == continued.output_text


def test_a_call_cut_short_can_be_continued(tool_server):
    """A response that the token limit stopped inside a call's arguments is stored as it
    was sent, and a continuation that answers the call goes on from it (the cut call with
    empty arguments); one that does not answer it is a 400, as on OpenAI."""
    client = tool_server.client()
    cut = forced_call(client, tool_server, max_output_tokens=6)
    assert cut.status == "incomplete"
    (call,) = cut.output
    assert call.type == "function_call" and call.status == "incomplete"
    assert not isinstance(load_json(call.arguments), dict)  # stored as written
    kwargs = dict(model=tool_server.model, max_output_tokens=4, extra_body=IGNORE_EOS, **GREEDY)
    with pytest.raises(openai.BadRequestError) as unanswered:
        client.responses.create(previous_response_id=cut.id, input="Go on.", **kwargs)
    assert f"No tool output found for function call {call.call_id}." in str(unanswered.value)
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "cut short"}
    continued = client.responses.create(previous_response_id=cut.id, input=[answer], **kwargs)
    assert continued.output[0].type == "message" and continued.output_text
    as_if_empty = client.responses.create(
        input=[
            {"role": "user", "content": "What is the weather like in Paris?"},
            {**call.model_dump(exclude_none=True), "arguments": "{}"},
            answer,
        ],
        store=False,
        **kwargs,
    )
    assert continued.usage.input_tokens == as_if_empty.usage.input_tokens
    assert continued.output_text == as_if_empty.output_text


def test_a_streamed_function_call(tool_server):
    client = tool_server.client()
    full = forced_call(client, tool_server)
    with client.responses.stream(
        model=tool_server.model,
        input="What is the weather like in Paris?",
        tools=[WEATHER_TOOL],
        tool_choice=FORCE_WEATHER,
        max_output_tokens=60,
        **GREEDY,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert collapse([e.type for e in events]) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (call,) = final.output
    assert call.arguments == full.output[0].arguments
    assert call.parsed_arguments == json.loads(call.arguments)  # strict: the helper parses
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_auto_reads_text_then_calls(tool_server, stream):
    """tool_choice auto through --tool-call-parser hermes; a guided choice of one exact
    text stands in for a model that writes content and a call."""
    arguments = {"location": "Paris", "unit": "celsius"}
    call = json.dumps({"name": "get_weather", "arguments": arguments})
    body = {
        "model": tool_server.model,
        "input": "What is the weather like in Paris?",
        "tools": [WEATHER_TOOL],
        "max_output_tokens": 200,
        "guided_choice": [f"Checking.\n<tool_call>\n{call}\n</tool_call>"],
    }
    if stream:
        events = sse_events(tool_server, body)
        added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        assert added == ["message", "function_call"]
        resp = Response.model_validate(events[-1]["response"])
    else:
        resp = raw_response(tool_server, **body)
    message, function_call = resp.output
    assert message.content[0].text == "Checking."
    assert function_call.name == "get_weather"
    assert json.loads(function_call.arguments) == arguments


def test_text_on_both_sides_of_a_call_is_laid_out_alike_streamed_or_not(tool_server):
    """Items in the order written, streamed or not (the reply not streamed put all its text
    in one message ahead of the calls)."""
    call = json.dumps({"name": "get_weather", "arguments": {"location": "Paris"}})
    body = {
        "model": tool_server.model,
        "input": "What is the weather like in Paris?",
        "tools": [WEATHER_TOOL],
        "max_output_tokens": 200,
        "guided_choice": [f"Checking.\n<tool_call>\n{call}\n</tool_call>\nThen more."],
    }
    streamed = Response.model_validate(sse_events(tool_server, body)[-1]["response"])
    whole = raw_response(tool_server, **body)
    for resp in (streamed, whole):
        assert [item.type for item in resp.output] == ["message", "function_call", "message"]
    texts = [
        [i.content[0].text for i in r.output if i.type == "message"] for r in (streamed, whole)
    ]
    assert texts[0] == texts[1] == ["Checking.", "\nThen more."]


# --- a failure mid-stream -----------------------------------------------------------------


def test_a_stream_past_the_deadline_ends_with_an_error_event(server_factory, long_context_model):
    """test_timeouts' server: requests stop after 0.5 s."""
    server = server_factory(
        "--max-model-len",
        "4096",
        "--request-timeout",
        "0.5",
        "--grammar-compile-timeout",
        "0.001",
        model=long_context_model,
    )
    body = {"input": "Once upon a time", "max_output_tokens": 4000, **IGNORE_EOS}
    events = sse_events(server, body)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    error, failed = events[-2:]
    assert error["code"] == "timeout_error" and "--request-timeout" in error["message"]
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == error["message"]
    assert any(e["type"] == "response.output_text.delta" for e in events)  # it had started
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert wait_until_idle(server)["serve_kv_cache_blocks_used"] == 0
    reply = httpx.post(f"{server.v1}/responses", json=body, timeout=60)
    assert assert_openai_error(reply, 504)["type"] == "timeout_error"
