"""A conversation, with its tools, to prompt text through the model's chat template: one
path for the server's chat (and what maps onto it) and the offline `LLM.chat`.

OpenAI's messages become the dicts HF chat templates expect: `content` never None (text
parts joined), a call's arguments an object (templates write `arguments | tojson`),
`tool_call_id` on tool results. Templates that know tools get them as `tools`; for those
that do not (SmolLM2's ChatML), the tool list goes into the system message and past calls
into the assistant's text, both in a tool parser's format, so that the model reads what it
is asked to write.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from serve.chat.tool_parsers import ToolParser, get_tool_parser
from serve.chat.tool_parsers.base import load_json

DEFAULT_TOOL_FORMAT = "hermes"  # how tools are described when no parser is configured
# apply_chat_template's own arguments, which chat_template_kwargs may not set.
RENDERING_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatRenderError(ValueError):
    """A conversation the template cannot render (the server answers 400)."""


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages (as the API validated them, or a script wrote them) as HF
    chat templates take them."""
    return [_template_message(message) for message in messages]


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(message, dict) or "role" not in message:
        raise ChatRenderError(f"A message is a dict with a role; got {message!r:.100}.")
    role = message["role"]
    entry: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
    if message.get("tool_calls"):
        entry["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": _arguments_object(call["function"].get("arguments")),
                },
            }
            for call in message["tool_calls"]
        ]
    if role == "tool":
        entry["tool_call_id"] = message.get("tool_call_id")
        if message.get("name"):
            entry["name"] = message["name"]
    return entry


def _text(content: Any) -> str:
    """A message's text: a string, or its text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatRenderError(f"Only text content parts can be rendered; got {kind!r}.")
        texts.append(part["text"])
    return "\n".join(texts)


def _arguments_object(arguments: Any) -> Any:
    """A past call's arguments as an object: OpenAI sends them as JSON text."""
    if isinstance(arguments, str):
        return load_json(arguments) if arguments.strip() else {}
    return arguments if arguments is not None else {}


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
        raise ChatRenderError(
            "This model has no chat template, so chats cannot be rendered. Give one (serve "
            "--chat-template FILE, or LLM.chat's chat_template), or send plain prompts "
            "(/v1/completions, LLM.generate)."
        )
    try:
        template = tokenizer.get_chat_template(chat_template, tools)
    except ValueError as e:
        raise ChatRenderError(f"No chat template to render with: {e}") from None
    reserved = sorted(set(template_kwargs or {}) & RENDERING_ARGUMENTS)
    if reserved:
        raise ChatRenderError(
            f"chat_template_kwargs: {reserved} are set by their own arguments, not as template "
            "variables."
        )
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
        raise ChatRenderError(f"The chat template cannot render these messages: {e}") from None
    if check_text is not None:
        check_text(text)
    return text, tokenizer(text, add_special_tokens=False).input_ids
