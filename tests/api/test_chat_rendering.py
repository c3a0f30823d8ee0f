"""What the chat handler hands the template, as vLLM's server does: the messages vLLM
takes that OpenAI defines (refusal parts, the function role), the tools' shape,
--exclude-tools-when-tool-choice-none, --default-chat-template-kwargs and
--chat-template-content-format; and those flags on the command line. No server: the
handler renders over a fake engine."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from serve.api.cli import build_parser
from serve.api.errors import APIError
from serve.api.request_checks import PromptCharLimit
from serve.api.serving_chat import ChatHandler, chat_request_from
from serve.api.settings import ServerSettings

USER = {"role": "user", "content": "Hi"}
TOOL = {"type": "function", "function": {"name": "get_time"}}  # no description, no parameters
# Shows what the template was given: its tools, a variable, each message's content.
SHOWN = (
    "{% if tools %}tools={{ tools | tojson }};{% endif %}"
    "{% if greeting is defined %}greeting={{ greeting }};{% endif %}"
    "{% for m in messages %}{{ m.role }}={{ m.content | tojson }};{% endfor %}"
)
PARTS = (  # loops over a message's content when it is a list
    "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from tiny_models import build_tokenizer

    return build_tokenizer()


def handler(tokenizer, template: str = SHOWN, **settings) -> ChatHandler:
    engine = SimpleNamespace(tokenizer=tokenizer, max_model_len=512)
    server = ServerSettings("m", "/m", chat_template=template, **settings)
    return ChatHandler(engine, server, PromptCharLimit(tokenizer, 512))


def rendered(chat: ChatHandler, **fields) -> str:
    return chat.render(chat_request_from({"messages": [USER], **fields}))[0]


def refused(fields: dict) -> APIError:
    with pytest.raises(APIError) as caught:
        chat_request_from(fields)
    assert caught.value.status == 400
    return caught.value


def test_an_assistant_refusal_part_is_taken_and_rendered_as_text(tokenizer):
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}
    text = rendered(handler(tokenizer), messages=[USER, refusal])
    assert text == 'user="Hi";assistant="I can\'t.";'
    echo = {"messages": [USER, refusal], "echo": True, "add_generation_prompt": False}
    assert handler(tokenizer).echoed(chat_request_from(echo)) == "I can't."


def test_a_refusal_part_belongs_to_an_assistant_message():
    error = refused(
        {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]}
    )
    assert error.param == "messages.0" and "only assistant messages" in error.message
    error = refused({"messages": [{"role": "assistant", "content": [{"type": "refusal"}]}]})
    assert error.param == "messages.0.content.0.refusal"


def test_a_function_message_is_taken_and_needs_its_name(tokenizer):
    result = {"role": "function", "name": "get_time", "content": "noon"}
    named = "{% for m in messages %}{{ m.role }}:{{ m.name }}={{ m.content }};{% endfor %}"
    text = rendered(handler(tokenizer, named), messages=[{**USER, "name": "ann"}, result])
    assert text == "user:ann=Hi;function:get_time=noon;"  # names reach the template
    assert refused({"messages": [{"role": "function", "content": "noon"}]}).param == "messages.0"


def test_a_role_openai_does_not_define_is_still_refused():
    assert refused({"messages": [{"role": "wizard", "content": "Hi"}]}).param == "messages.0.role"


def test_tools_reach_the_template_as_vllm_hands_them(tokenizer):
    text = rendered(handler(tokenizer), tools=[TOOL])
    tools = json.loads(text.removeprefix("tools=").split(";")[0])
    assert tools == [
        {
            "type": "function",
            "function": {"name": "get_time", "description": None, "parameters": None},
        }
    ]
    # serve's own tools block, for a template that ignores tools, lists what was given.
    block = rendered(handler(tokenizer, "{{ messages[0].content }}"), tools=[TOOL])
    assert json.dumps(TOOL) in block and "null" not in block


@pytest.mark.parametrize("template", [SHOWN, "{{ messages[0].content }}"], ids=["knows", "ignores"])
def test_tool_choice_none_renders_no_tools_with_the_flag(tokenizer, template):
    """A template that ignores tools gets serve's tools block in its system prompt; the
    flag leaves that out too."""
    excluding = handler(tokenizer, template, exclude_tools_when_tool_choice_none=True)
    assert "get_time" not in rendered(excluding, tools=[TOOL], tool_choice="none")
    assert "get_time" in rendered(excluding, tools=[TOOL], tool_choice="required")
    assert "get_time" in rendered(handler(tokenizer, template), tools=[TOOL], tool_choice="none")


def test_default_template_kwargs_apply_under_the_requests_own(tokenizer):
    chat = handler(tokenizer, default_chat_template_kwargs={"greeting": "hello"})
    assert rendered(chat).startswith("greeting=hello;")
    assert rendered(chat, chat_template_kwargs={"greeting": "hi"}).startswith("greeting=hi;")
    assert rendered(chat, chat_template_kwargs={"greeting": None}).startswith("greeting=hello;")
    assert "greeting" not in rendered(handler(tokenizer))


def test_an_assistants_past_reasoning_reaches_the_template_by_both_names(tokenizer):
    """vLLM's: `reasoning` (or its older name `reasoning_content`) of an assistant turn is
    handed over as both (Qwen3's template reads `reasoning_content`); an assistant turn
    may carry reasoning alone."""
    thought = (
        "{% for m in messages %}{{ m.role }}:{{ m.reasoning_content }}/{{ m.reasoning }}"
        "={{ m.content }};{% endfor %}"
    )
    chat = handler(tokenizer, thought)
    for name in ("reasoning", "reasoning_content"):
        turn = {"role": "assistant", name: "Think.", "content": "Paris."}
        text = rendered(chat, messages=[USER, turn, USER])
        assert text == "user:/=Hi;assistant:Think./Think.=Paris.;user:/=Hi;"
    both = {"role": "assistant", "reasoning": "new", "reasoning_content": "old", "content": "A"}
    assert "assistant:new/new=A;" in rendered(chat, messages=[USER, both])
    alone = {"role": "assistant", "reasoning": "Think."}
    assert "assistant:Think./Think.=;" in rendered(chat, messages=[USER, alone])


def test_reasoning_effort_reaches_the_template_as_vllm_hands_it(tokenizer):
    shown = "{{ reasoning_effort }}/{{ enable_thinking }}"
    chat = handler(tokenizer, shown)
    assert rendered(chat, reasoning_effort="low") == "low/True"
    assert rendered(chat, reasoning_effort="none") == "none/False"
    kwargs = {"enable_thinking": True}
    assert rendered(chat, reasoning_effort="none", chat_template_kwargs=kwargs) == "none/True"
    assert rendered(chat) == "/"  # neither set without an effort


def test_the_content_format_setting_decides_what_the_template_gets(tokenizer):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    fields = {"messages": [{"role": "user", "content": parts}]}
    for content_format, expected in [("auto", "[a][b]"), ("openai", "[a][b]"), ("string", "a\nb")]:
        chat = handler(tokenizer, PARTS, chat_template_content_format=content_format)
        assert chat.render(chat_request_from(fields))[0] == expected


def test_the_rendering_flags_parse():
    args = build_parser().parse_args(
        [
            "--default-chat-template-kwargs",
            '{"enable_thinking": false}',
            "--chat-template-content-format",
            "openai",
            "--exclude-tools-when-tool-choice-none",
        ]
    )
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    assert args.chat_template_content_format == "openai"
    assert args.exclude_tools_when_tool_choice_none is True
    defaults = build_parser().parse_args([])
    assert defaults.chat_template_content_format == "auto"
    assert not defaults.default_chat_template_kwargs
    assert not defaults.exclude_tools_when_tool_choice_none


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{enable_thinking: false}", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"tools": []}', "set by each request's own fields"),
    ],
)
def test_bad_default_template_kwargs_stop_serve_with_the_flag_named(value, message, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--default-chat-template-kwargs", value])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "--default-chat-template-kwargs" in error and message in error


def test_the_flags_reach_a_running_servers_chat(server_factory, tokenizer):
    """The command line's values are what the server renders with (one server, all three)."""
    server = server_factory(
        "--chat-template",
        SHOWN,
        "--default-chat-template-kwargs",
        '{"greeting": "hello"}',
        "--chat-template-content-format",
        "openai",
        "--exclude-tools-when-tool-choice-none",
    )
    body = {
        "model": server.model,
        "messages": [USER],
        "tools": [TOOL],
        "tool_choice": "none",
        "max_tokens": 1,
        "return_token_ids": True,
    }
    reply = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    prompt = tokenizer.decode(reply.json()["prompt_token_ids"])
    assert prompt == 'greeting=hello;user=[{"type": "text", "text": "Hi"}];'
    # /tokenize counts the prompt chat renders: tool_choice "none" leaves the tools out
    # there too (it counted them, ignoring tool_choice).
    fields = {key: body[key] for key in ("model", "messages", "tools", "tool_choice")}
    counted = httpx.post(f"{server.url}/tokenize", json=fields, timeout=60).json()
    assert counted["tokens"] == reply.json()["prompt_token_ids"]
    with_tools = httpx.post(f"{server.url}/tokenize", json={**fields, "tool_choice": "auto"})
    assert with_tools.json()["count"] > counted["count"]
