"""What real clients send back and ask for, checked without a server: a history replayed
from OpenAI (a call cut short, a message-level refusal), the Responses API's rule that
every function call has its output (across a previous_response_id chain too), OpenAI's
fields serve cannot honour refused by name, and completions' null max_tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from serve.api.errors import APIError
from serve.api.protocol import CompletionRequest
from serve.api.protocol_responses import FunctionCallItem, MessageItem, ResponsesRequest
from serve.api.request_checks import PromptCharLimit, fit_prompt
from serve.api.response_store import ResponseStore
from serve.api.serving_chat import ChatHandler, chat_request_from
from serve.api.serving_responses import ResponsesHandler
from serve.api.settings import ServerSettings

USER = {"role": "user", "content": "Weather in Paris?"}
# Shows each message's content and its calls' arguments as the template gets them.
SHOWN = (
    "{% for m in messages %}{{ m.role }}={{ m.content | tojson }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }}{{ c.function.arguments | tojson }}]"
    "{% endfor %};{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from tiny_models import build_tokenizer

    return build_tokenizer()


def chat_handler(tokenizer) -> ChatHandler:
    engine = SimpleNamespace(tokenizer=tokenizer, max_model_len=512)
    server = ServerSettings("m", "/m", chat_template=SHOWN)
    return ChatHandler(engine, server, PromptCharLimit(tokenizer, 512))


def rendered(tokenizer, messages: list[dict]) -> str:
    return chat_handler(tokenizer).render(chat_request_from({"messages": messages}))[0]


def refused(fields: dict) -> APIError:
    with pytest.raises(APIError) as caught:
        chat_request_from(fields)
    assert caught.value.status == 400
    return caught.value


def assistant_call(arguments: str) -> dict:
    function = {"name": "weather", "arguments": arguments}
    return {"role": "assistant", "tool_calls": [{"id": "call_1", "function": function}]}


# --- a call cut short by max_tokens, sent back ---------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "shown"),
    [
        ('{"city": "arch', "{}"),  # cut short: the cookbook's replay of a "length" call
        ("", "{}"),
        ("[1, 2]", "{}"),  # JSON, but not an object
        ('{"city": "Paris"}', '{"city": "Paris"}'),
    ],
)
def test_any_arguments_text_is_taken_and_rendered_as_an_object(tokenizer, arguments, shown):
    text = rendered(tokenizer, [USER, assistant_call(arguments)])
    assert text == f'user="Weather in Paris?";assistant=""[weather{shown}];'


def test_a_responses_function_call_takes_any_arguments_text():
    call = {"type": "function_call", "call_id": "call_1", "name": "weather"}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    request = ResponsesRequest.model_validate(
        {"input": [USER, {**call, "arguments": '{"city": "arch'}, output]}
    )
    assert request.input_items[1].arguments == '{"city": "arch'


# --- a message-level refusal ---------------------------------------------------------------


def test_an_assistant_refusal_is_taken_and_rendered_as_its_text(tokenizer):
    refusal = {"role": "assistant", "content": None, "refusal": "I can't."}
    assert rendered(tokenizer, [USER, refusal]).endswith('assistant="I can\'t.";')
    both = {"role": "assistant", "content": "Well.", "refusal": "No."}
    assert rendered(tokenizer, [USER, both]).endswith('assistant="Well.\\nNo.";')
    # The text a continued message's echo starts with, as a refusal part's is.
    echo = {"messages": [USER, refusal], "echo": True, "add_generation_prompt": False}
    assert chat_handler(tokenizer).echoed(chat_request_from(echo)) == "I can't."


def test_a_refusal_belongs_to_an_assistant_message():
    error = refused({"messages": [{**USER, "refusal": "No."}]})
    assert error.param == "messages.0" and "only assistant messages" in error.message
    error = refused({"messages": [USER, {"role": "assistant", "content": None}]})
    assert error.param == "messages.1.content" and "refusal" in error.message


# --- OpenAI's fields serve cannot honour ---------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"functions": [{"name": "weather", "parameters": {}}]}, ["tools"]),
        ({"function_call": {"name": "weather"}}, ["tool_choice"]),
        ({"function_call": "auto"}, ["tool_choice"]),
        ({"modalities": ["text", "audio"]}, ["audio", '["text"]']),
        ({"audio": {"voice": "alloy", "format": "wav"}}, ["audio output"]),
        ({"web_search_options": {"search_context_size": "low"}}, ["web search", "tools"]),
    ],
    ids=["functions", "function_call", "function_call-auto", "modalities", "audio", "web_search"],
)
def test_fields_that_change_the_reply_are_a_400_naming_them(fields, words):
    error = refused({"messages": [USER], **fields})
    (name,) = fields
    assert error.param == name
    assert all(word in error.message for word in words), error.message


@pytest.mark.parametrize(
    "fields",
    [
        {"modalities": ["text"]},
        {"function_call": "none"},
        {"functions": []},
        {"web_search_options": {}},
        {"prediction": {"type": "content", "content": "Sunny."}},  # latency only
    ],
)
def test_their_neutral_values_are_taken(fields):
    assert chat_request_from({"messages": [USER], **fields}).messages[0].content == USER["content"]


# --- the Responses API: every function_call has its output ---------------------------------


CALL = {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}


def responses_handler(store: ResponseStore) -> ResponsesHandler:
    return ResponsesHandler(SimpleNamespace(engine=None, settings=None), store)


def turn_messages(store: ResponseStore, **body) -> list[dict]:
    turn = responses_handler(store)._turn(ResponsesRequest.model_validate(body))
    return [message.model_dump(exclude_none=True) for message in turn.chat.messages]


def test_a_function_call_without_its_output_is_a_400():
    store = ResponseStore(4, 60.0)
    with pytest.raises(APIError) as caught:
        turn_messages(store, input=[USER, CALL])
    assert (caught.value.status, caught.value.param) == (400, "input")
    assert caught.value.message == "No tool output found for function call call_1."
    roles = [m["role"] for m in turn_messages(store, input=[USER, CALL, OUTPUT])]
    assert roles == ["user", "assistant", "tool"]


def test_a_chain_answers_an_earlier_responses_call_in_its_input():
    store = ResponseStore(4, 60.0)
    made_call = [MessageItem.model_validate(USER), FunctionCallItem.model_validate(CALL)]
    store.put("resp_a", {"id": "resp_a", "output": []}, made_call)
    messages = turn_messages(store, previous_response_id="resp_a", input=[OUTPUT])
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[2]["tool_call_id"] == "call_1"
    with pytest.raises(APIError) as caught:
        turn_messages(store, previous_response_id="resp_a", input="And tomorrow?")
    assert caught.value.message == "No tool output found for function call call_1."


# --- completions' max_tokens: null --------------------------------------------------------


def test_completions_null_max_tokens_is_16_as_in_vllm(tokenizer):
    """Left out or null, completions' max_tokens is 16 (vLLM's default, which it also gives
    a null), not the generation config's default nor the room left."""
    settings = ServerSettings("m", "/m", sampling_defaults={"max_tokens": 100})
    for body in ('{"prompt": "Hi"}', '{"prompt": "Hi", "max_tokens": null}'):
        request = CompletionRequest.model_validate_json(body)
        assert request.requested_max_tokens == 16
        *_, budget = fit_prompt("Hi", [1, 2], request, tokenizer, 512, settings)
        assert budget == 16
