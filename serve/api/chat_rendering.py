"""A conversation, with its tools, to prompt text through the model's chat template.

OpenAI's messages become the dicts HF chat templates expect: `content` never None, a
call's arguments an object (templates write `arguments | tojson`), `tool_call_id` on tool
results. Templates that know tools get them as `tools`; for those that do not (SmolLM2's
ChatML), the tool list goes into the system message and past calls into the assistant's
text, both in a tool parser's format, so that the model reads what it is asked to write.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from serve.api.errors import APIError
from serve.api.protocol import ChatMessage
from serve.api.tool_parsers import ToolParser, get_tool_parser

DEFAULT_TOOL_FORMAT = "hermes"  # how tools are described when no parser is configured


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as HF chat templates take them."""
    rendered = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": call.function.arguments_object,
                    },
                }
                for call in message.tool_calls
            ]
        if message.role == "tool":
            entry["tool_call_id"] = message.tool_call_id
            if message.name:
                entry["name"] = message.name
        rendered.append(entry)
    return rendered


def _mentions(template: str, variable: str) -> bool:
    return re.search(rf"\b{variable}\b", template) is not None


def _with_tools_prompt(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    """The tools' description at the end of the system message (a new one if none)."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        text = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [{**first, "content": text}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _calls_as_text(message: dict[str, Any], tool_format: ToolParser) -> dict[str, Any]:
    if "tool_calls" not in message:
        return message
    calls = [call["function"] for call in message["tool_calls"]]
    text = tool_format.calls_text(calls)
    content = f"{message['content']}\n{text}" if message["content"] else text
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    chat_template: str | None,
    tools: list[dict[str, Any]] | None = None,
    tool_format: ToolParser | None = None,
    check_text: Callable[[str], None] | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """The prompt text and ids for a conversation (`template_messages`) and its tools
    (OpenAI's tool objects). `tool_format` (default hermes) writes the tools and past calls
    that the template does not. `check_text` sees the text before it is tokenized. With
    `continue_final_message` the prompt ends inside the final message, for the model to
    continue it. `template_kwargs` are more variables for the template (vLLM's
    `chat_template_kwargs`)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400,
            "This model has no chat template, so chat completions cannot be rendered. Start "
            "the server with --chat-template FILE (a Jinja template), or use /v1/completions.",
        )
    try:
        template = tokenizer.get_chat_template(chat_template, tools)
    except ValueError as e:
        raise APIError(400, f"No chat template to render with: {e}") from None
    tool_format = tool_format or get_tool_parser(DEFAULT_TOOL_FORMAT)
    if tools and not _mentions(template, "tools"):
        messages = _with_tools_prompt(messages, tool_format.tools_prompt(tools))
    if not _mentions(template, "tool_calls"):
        messages = [_calls_as_text(m, tool_format) for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
    except Exception as e:  # a template may raise on roles it does not support
        raise APIError(400, f"The chat template cannot render these messages: {e}") from None
    if check_text is not None:
        check_text(text)
    return text, tokenizer(text, add_special_tokens=False).input_ids
