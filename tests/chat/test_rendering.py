"""A conversation through the chat template as vLLM renders it: the developer role on
templates that do not name it, refusal parts, the function role, content as text or as
OpenAI's parts (and which a template reads); no server."""

from __future__ import annotations

import pytest

from serve.chat.content_format import detect_content_format
from serve.chat.rendering import ChatRenderError, render_chat, template_messages

# SmolLM2-135M-Instruct's template: a default system prompt unless the first message is
# a system one; it never names the developer role.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM"
# A template that knows the developer role (quoted, as vLLM looks for it).
WITH_DEVELOPER = (
    "{% for m in messages %}{% if m.role == 'developer' %}[dev]{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)
# Gemma 3's way with content: a string, or its parts, each trimmed.
PARTS = (
    "{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}"
    "{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
)
USER = {"role": "user", "content": "Hi"}


@pytest.fixture(scope="module")
def tokenizer():
    from tiny_models import build_tokenizer

    return build_tokenizer()


def render(tokenizer, messages, template=SMOLLM2, **options) -> str:
    return render_chat(tokenizer, messages, False, template, **options)[0]


def test_a_developer_message_is_the_system_prompt_of_a_template_without_that_role(tokenizer):
    text = render(tokenizer, [{"role": "developer", "content": "Be terse."}, USER])
    assert text == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert DEFAULT_SYSTEM not in text


def test_developer_messages_join_the_system_prompt_first(tokenizer):
    messages = [
        {"role": "system", "content": "Be kind."},
        USER,
        {"role": "developer", "content": "Be terse."},
        {"role": "developer", "content": ""},
    ]
    text = render(tokenizer, messages)
    assert text == (
        "<|im_start|>system\nBe kind.\n\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_a_template_that_names_the_developer_role_gets_it(tokenizer):
    text = render(tokenizer, [{"role": "developer", "content": "Be terse."}, USER], WITH_DEVELOPER)
    assert text.startswith("[dev]<|im_start|>developer\nBe terse.<|im_end|>")


def test_a_refusal_part_is_rendered_as_its_text(tokenizer):
    refused = {
        "role": "assistant",
        "content": [{"type": "text", "text": "Hmm."}, {"type": "refusal", "refusal": "No."}],
    }
    text = render(tokenizer, [USER, refused])
    assert "<|im_start|>assistant\nHmm.\nNo.<|im_end|>" in text
    # OpenAI's message-level refusal, as a script replays it (the API makes it a part)
    replayed = {"role": "assistant", "content": None, "refusal": "No."}
    assert "<|im_start|>assistant\nNo.<|im_end|>" in render(tokenizer, [USER, replayed])


def test_a_function_message_is_rendered_in_its_role_with_its_name(tokenizer):
    message = {"role": "function", "name": "get_weather", "content": "22 degrees"}
    named = {"role": "user", "name": "ann", "content": "Hi"}
    assert template_messages([named, message]) == [  # names kept, as vLLM keeps them
        {"role": "user", "name": "ann", "content": "Hi"},
        {"role": "function", "name": "get_weather", "content": "22 degrees"},
    ]
    assert "<|im_start|>function\n22 degrees<|im_end|>" in render(tokenizer, [USER, message])


def test_content_format_auto_reads_the_template():
    assert detect_content_format(SMOLLM2) == "string"
    assert detect_content_format(PARTS) == "openai"
    macro = (
        "{% macro text(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages[1:] %}{{ text(m['content']) }}{% endfor %}"
    )
    assert detect_content_format(macro) == "openai"
    assert detect_content_format("{% for m in messages %}") == "string"  # does not parse


def test_a_template_that_loops_over_parts_gets_them(tokenizer):
    spaced = {
        "role": "user",
        "content": [{"type": "text", "text": " a "}, {"type": "text", "text": "b"}],
    }
    # auto: the parts, each trimmed by the template, as vLLM renders it.
    assert render(tokenizer, [spaced], PARTS) == "<start_of_turn>user\nab<end_of_turn>\n"
    joined = render(tokenizer, [spaced], PARTS, content_format="string")
    assert joined == "<start_of_turn>user\na \nb<end_of_turn>\n"
    plain = render(tokenizer, [USER], PARTS, content_format="openai")  # a string is one part
    assert plain == "<start_of_turn>user\nHi<end_of_turn>\n"


def test_parts_reach_the_template_as_openai_lists(tokenizer):
    shown = "{% for m in messages %}{{ m.role }}={{ m.content | tojson }};{% endfor %}"
    messages = [
        USER,
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "1"}] * 2},
    ]
    text = render(tokenizer, messages, shown, content_format="openai")
    assert text == (
        'user=[{"type": "text", "text": "Hi"}];'
        'assistant=[{"type": "text", "text": "No."}];'
        'tool="1\\n1";'  # a tool result stays text, as vLLM hands it over
    )


def test_an_unknown_content_format_is_a_render_error(tokenizer):
    with pytest.raises(ChatRenderError, match="auto, string, openai"):
        render(tokenizer, [USER], content_format="parts")


@pytest.mark.parametrize(
    ("arguments", "shown"),
    [
        ('{"city": "Par', "{}"),  # a call cut short by max_tokens
        ("[1]", "{}"),
        ("", "{}"),
        (None, "{}"),
        ({"city": "Paris"}, '{"city": "Paris"}'),  # a script's own object
        ('{"city": "Paris"}', '{"city": "Paris"}'),
    ],
)
def test_a_past_calls_arguments_reach_the_template_as_an_object(tokenizer, arguments, shown):
    """Arguments text that is no JSON object is an empty one, as vLLM coerces it."""
    template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}"
    )
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    assert render(tokenizer, [USER, {"role": "assistant", "tool_calls": [call]}], template) == shown
