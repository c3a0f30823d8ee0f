"""A conversation, with its tools, to prompt text through the model's chat template: one
path for the server's chat (and what maps onto it) and the offline `LLM.chat`.

OpenAI's messages become the dicts HF chat templates expect, as vLLM hands them over:
`content` never None (text and refusal parts joined, or for a template that loops over
the parts, OpenAI's list of them: `content_format.py`), a call's arguments an object
(templates write `arguments | tojson`), `tool_call_id` on tool results, `name` where the
message has one (the deprecated `function` role's included), an assistant's reasoning as
`reasoning` and `reasoning_content` (either name taken). A template that never names
the `developer` role gets developer messages as system ones (vLLM's rule). Templates that
know tools get them as `tools`; for those that do not (SmolLM2's ChatML), the tool list
goes into the system message and past calls into the assistant's text, both in a tool
parser's format, so that the model reads what it is asked to write (vLLM writes neither).

Images (for a model that takes them: `image_placeholder`, its placeholder text) are
`image_url` parts (vLLM's short form `{"image_url": "<url>"}` too) or, offline, vLLM's
`image_pil` parts, in any role, as vLLM takes them. A template that loops over the parts
gets `{"type": "image"}` where each stood (what HF templates of vision models write the
placeholder for); for one that takes text, each message's images become placeholders on
lines of their own before its text, less those its text already places (vLLM's rule).
`chat_images` lists them in the same order, the order their placeholders take in the
prompt; the caller reads and processes them (this package imports no model code).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serve.chat.content_format import resolve_content_format
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


def template_messages(
    messages: list[dict[str, Any]],
    content_format: str = "string",
    image_placeholder: str | None = None,
) -> list[dict[str, Any]]:
    """OpenAI-shaped messages (as the API validated them, or a script wrote them) as HF
    chat templates take them; `content_format` "string" or "openai" (content_format.py).
    `image_placeholder`: the model's placeholder text; None, a model that takes no images
    (an image part is refused)."""
    return [_template_message(m, content_format, image_placeholder) for m in messages]


def chat_images(messages: list[dict[str, Any]]) -> list[Any]:
    """A conversation's images in prompt order: each `image_url` part's URL, each
    `image_pil` part's image."""
    return [
        item.source
        for message in messages
        if isinstance(message, dict)
        for item in _content_items(message.get("content"))
        if isinstance(item, _Image)
    ]


def _template_message(
    message: dict[str, Any], content_format: str, image_placeholder: str | None
) -> dict[str, Any]:
    if not isinstance(message, dict) or "role" not in message:
        raise ChatRenderError(f"A message is a dict with a role; got {message!r:.100}.")
    role = message["role"]
    items = _content_items(message.get("content"))
    if isinstance(message.get("refusal"), str):  # an assistant's, beside its content
        items.append(message["refusal"])
    texts = [item for item in items if isinstance(item, str)]
    num_images = len(items) - len(texts)
    if num_images and image_placeholder is None:
        raise ChatRenderError("This model takes no images: send text content parts alone.")
    # A tool result is text in either format (templates write it as one string), unless
    # it holds images, which keep their place among its parts (as vLLM keeps them).
    if content_format == "openai" and (role != "tool" or num_images):
        content: Any = [
            {"type": "text", "text": item} if isinstance(item, str) else {"type": "image"}
            for item in items
        ]
    else:
        content = _with_placeholders("\n".join(texts), num_images, image_placeholder)
    entry: dict[str, Any] = {"role": role, "content": content}
    if isinstance(message.get("name"), str):
        entry["name"] = message["name"]
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
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    if role == "assistant" and isinstance(reasoning, str):
        # vLLM's interleaved thinking: Qwen3's template writes it back as <think> ...
        entry["reasoning"] = entry["reasoning_content"] = reasoning
    return entry


# The text a part of each kind carries: an assistant's refusal is rendered as its text.
_PART_TEXT = {"text": "text", "refusal": "refusal"}
# The field of an image part of each kind: a URL (or {"url": ...}), or offline a PIL image.
_PART_IMAGE = {"image_url": "image_url", "image_pil": "image_pil"}


@dataclass(frozen=True)
class _Image:
    source: Any  # a URL, or a PIL image


def _content_items(content: Any) -> list[str | _Image]:
    """A message's content as its texts and images, in order: a string, or its parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    items: list[str | _Image] = []
    for part in content:
        kind = _part_kind(part)
        if kind in _PART_TEXT:
            items.append(part[_PART_TEXT[kind]])
        elif kind in _PART_IMAGE:
            items.append(_Image(_image_source(part.get(_PART_IMAGE[kind]))))
        else:
            raise ChatRenderError(
                f"Only text, refusal and image (image_url) content parts can be rendered; "
                f"got {kind!r}."
            )
    return items


def _part_kind(part: Any) -> Any:
    if not isinstance(part, dict):
        return type(part).__name__
    if part.get("type") is None:  # vLLM's short forms, {"image_url": "<url>"} and image_pil's
        return next((kind for kind in _PART_IMAGE if kind in part), None)
    return part["type"]


def _image_source(value: Any) -> Any:
    """An image part's URL (given as the URL or as {"url": ...}) or image."""
    url = value.get("url") if isinstance(value, dict) else value
    if url is None or url == "":
        raise ChatRenderError(f"An image part needs its image or URL; got {value!r:.100}.")
    return url


def _with_placeholders(text: str, num_images: int, placeholder: str | None) -> str:
    """A message's text with its images' placeholders, as vLLM writes it for a template
    that takes text: one per image its text does not place already, each on a line of its
    own before the text."""
    if not num_images or placeholder is None:
        return text
    num_missing = num_images - text.count(placeholder)
    if num_missing < 0:
        raise ChatRenderError(
            f"A message's text holds {text.count(placeholder)} image placeholders "
            f"({placeholder}) for {num_images} image{'s' * (num_images != 1)}."
        )
    return "\n".join([placeholder] * num_missing + ([text] if text else []))


def _joined(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if p.get("type") == "text")


def _appended(content: str | list[dict[str, Any]], text: str, separator: str) -> Any:
    """A message's content with `text` added at its end: after `separator`, or as one
    more part."""
    if isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    return f"{content}{separator}{text}" if content else text


def _arguments_object(arguments: Any) -> dict[str, Any]:
    """A past call's arguments as an object: OpenAI sends them as JSON text. Text that is
    not a JSON object (a call cut short by max_tokens, `[]`) is an empty one, as vLLM
    coerces it: templates write `arguments | tojson` and need a mapping, and refusing the
    history would fail every later turn of the conversation."""
    if isinstance(arguments, str):
        arguments = load_json(arguments)
    return arguments if isinstance(arguments, dict) else {}


def _mentions(template: str, variable: str) -> bool:
    return re.search(rf"\b{variable}\b", template) is not None


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's rule for a template that never names the developer role (as a quoted
    string): developer messages become system ones; then, if a system message stands
    anywhere but first, the system messages' texts (blank line apart) make one first
    message."""
    if not any(m["role"] == "developer" for m in messages):
        return messages
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    if [i for i, m in enumerate(messages) if m["role"] == "system"] == [0]:
        return messages
    texts = [_joined(m["content"]) for m in messages if m["role"] == "system"]
    system = {"role": "system", "content": "\n\n".join(text for text in texts if text)}
    return [system, *(m for m in messages if m["role"] != "system")]


def _given_fields(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as its tools block lists it: without the null fields (a missing description)
    that a template is handed."""
    function = tool.get("function")
    if not isinstance(function, dict):
        return tool
    return {**tool, "function": {k: v for k, v in function.items() if v is not None}}


def _with_tools_prompt(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    """The tools' description at the end of the system message (a new one if none)."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{**first, "content": _appended(first["content"], prompt, "\n\n")}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _calls_as_text(message: dict[str, Any], tool_format: ToolParser) -> dict[str, Any]:
    if "tool_calls" not in message:
        return message
    calls = [call["function"] for call in message["tool_calls"]]
    content = _appended(message["content"], tool_format.calls_text(calls), "\n")
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
    content_format: str = "auto",
    image_placeholder: str | None = None,
) -> tuple[str, list[int]]:
    """The prompt text and ids for a conversation (OpenAI's messages, made
    `template_messages` here) and its tools (OpenAI's tool objects). `tool_format`
    (default hermes) writes the tools and past calls that the template does not.
    `check_text` sees the text before it is tokenized. With `continue_final_message` the
    prompt ends inside the final message, for the model to continue it. `template_kwargs`
    are more variables for the template (vLLM's `chat_template_kwargs`); `content_format`
    is vLLM's `chat_template_content_format` (auto, string, openai). `image_placeholder`:
    the text that places an image, for a model that takes them (the images themselves are
    `chat_images(messages)`, in the order of their placeholders); None refuses images."""
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
    try:
        content_format = resolve_content_format(content_format, template)
    except ValueError as e:
        raise ChatRenderError(str(e)) from None
    messages = template_messages(messages, content_format, image_placeholder)
    if "'developer'" not in template and '"developer"' not in template:
        messages = _developer_as_system(messages)
    tool_format = tool_format or get_tool_parser(DEFAULT_TOOL_FORMAT)
    if tools and not _mentions(template, "tools"):
        prompt = tool_format.tools_prompt([_given_fields(tool) for tool in tools])
        messages = _with_tools_prompt(messages, prompt)
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
