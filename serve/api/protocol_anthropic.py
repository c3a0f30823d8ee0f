"""Anthropic's Messages API request shapes (pydantic), and their mapping onto the chat
path's request (OpenAI's messages, tools and tool_choice), which renders, limits and
samples them.

As on the OpenAI paths, unknown fields are accepted and ignored (`cache_control`,
`citations`, beta fields). What this server cannot do is refused with a 400 that names
it: document blocks, images anywhere but a user's turn, server tools. A user's `image`
blocks (base64 or URL sources) become chat's `image_url` parts, in their place among its
text, so the chat path reads them as it reads OpenAI's (a model without images refuses them).

The mapping: `system` becomes a system message; text blocks are joined with newlines (as
the chat path joins text parts); an assistant's `tool_use` blocks become its `tool_calls`;
a user's `tool_result` blocks become `tool` messages, in their order among its text; an
assistant's `thinking` blocks become its `reasoning` (`redacted_thinking` ones, opaque,
are dropped), as vLLM 0.32 maps them. `thinking` {"type": "disabled"} is chat's
`reasoning_effort` "none" (the template's `enable_thinking` false), over
`output_config.effort`; "enabled" and "adaptive" change nothing: serve has no thinking
token budget, so `budget_tokens` is checked (at least 1024, less than max_tokens, as
vLLM's) but not enforced.
Consecutive turns of one role are merged into one, as Anthropic's API does. A conversation
that ends with an assistant's text is a prefill: the model continues that text.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from serve.api.protocol import OpenAIModel

# The content blocks this server reads, per place they may appear.
_READ_BLOCKS = {
    "user": ("text", "image", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
    "system": ("text",),
    "tool_result": ("text",),
}


def _supported_blocks(place: str):
    """A before-validator refusing, by name, content blocks of types this server does not
    read in `place` (images, documents, thinking, server-tool results, ...)."""
    allowed = _READ_BLOCKS[place]

    def check(content: Any) -> Any:
        if not isinstance(content, list):
            return content
        for index, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in allowed:
                names = " and ".join(allowed)
                raise PydanticCustomError(
                    "unsupported_content",
                    "block {index} is of type '{kind}', which this server does not support "
                    "in {place} content (it reads {names} blocks)",
                    {"index": index, "kind": kind, "place": place, "names": names},
                )
        return content

    return check


class TextBlock(OpenAIModel):
    type: Literal["text"]
    text: str


class Base64Source(OpenAIModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class URLSource(OpenAIModel):
    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(OpenAIModel):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]

    def chat_part(self) -> dict[str, Any]:
        """As chat's `image_url` part (a base64 source as a data URL)."""
        source = self.source
        if isinstance(source, URLSource):
            url = source.url
        else:
            url = f"data:{source.media_type};base64,{source.data}"
        return {"type": "image_url", "image_url": {"url": url}}


class ToolUseBlock(OpenAIModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(OpenAIModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    _supported = field_validator("content", mode="before")(_supported_blocks("tool_result"))

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else _joined(self.content)
        return f"Error: {text}" if self.is_error else text  # the model has no other flag


class ThinkingBlock(OpenAIModel):
    """A reply's thinking sent back; its `signature` (serve's are random) is not checked."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(OpenAIModel):
    type: Literal["redacted_thinking"]
    data: str | None = None


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class InputMessage(OpenAIModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _supported(cls, content: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        return _supported_blocks(role)(content) if role in _READ_BLOCKS else content

    @property
    def blocks(self) -> list[ContentBlock]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Tool(OpenAIModel):
    """A client tool: the model writes its `input`, the client runs it."""

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise ValueError(
                f"server tools (type {kind!r}) are not supported by this server; give client "
                "tools: name, description, input_schema"
            )
        return data

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type") != "object":
            raise ValueError('must be a JSON schema of type "object"')
        return schema


class ToolChoiceAuto(OpenAIModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(OpenAIModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(OpenAIModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(OpenAIModel):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIModel):
    format: OutputFormat | None = None
    # Chat's reasoning_effort (thinking disabled overrides it), as vLLM maps it.
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class ThinkingEnabled(OpenAIModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)  # not enforced: serve has no thinking budget
    # `display` is accepted and ignored (as vLLM's): the thinking is always returned.


class ThinkingDisabled(OpenAIModel):
    type: Literal["disabled"]


class ThinkingAdaptive(OpenAIModel):
    type: Literal["adaptive"]


Thinking = Annotated[
    ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")
]


class Metadata(OpenAIModel):
    user_id: str | None = None


class MessagesInput(OpenAIModel):
    """What a prompt is made of: the fields /v1/messages/count_tokens takes."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    _supported_system = field_validator("system", mode="before")(_supported_blocks("system"))

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [tool.name for tool in tools or []]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"tool names must be unique; repeated: {repeated}")
        return tools

    @model_validator(mode="after")
    def _choice_among_tools(self) -> MessagesInput:
        choice = self.tool_choice
        names = [tool.name for tool in self.tools or []]
        if isinstance(choice, (ToolChoiceAny, ToolChoiceTool)) and not names:
            raise ValueError(f'tool_choice "{choice.type}" needs tools')
        if isinstance(choice, ToolChoiceTool) and choice.name not in names:
            raise ValueError(
                f"tool_choice names the tool {choice.name!r}, which is not among the tools "
                f"({', '.join(names)})"
            )
        forced = isinstance(choice, (ToolChoiceAny, ToolChoiceTool))
        if forced and self.output_config is not None and self.output_config.format is not None:
            raise ValueError(
                f'tool_choice "{choice.type}" sets the output\'s format itself; it cannot be '
                "combined with output_config.format"
            )
        return self

    @model_validator(mode="after")
    def _final_turn(self) -> MessagesInput:
        last = self.messages[-1]
        if last.role == "assistant" and any(b.type == "tool_use" for b in last.blocks):
            raise ValueError(
                "the final assistant message holds tool_use blocks: send their tool_result "
                "blocks in a user message after it"
            )
        return self

    def chat_fields(self) -> dict[str, Any]:
        """The chat path's request (OpenAI's field names) for this conversation."""
        messages = _merged(_chat_messages(self.system, self.messages))
        prefill = messages[-1]["role"] == "assistant"
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "add_generation_prompt": not prefill,
            "continue_final_message": prefill,
        }
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.input_schema,
                    },
                }
                for tool in self.tools
            ]
            fields.update(_chat_tool_choice(self.tool_choice))
        if self.output_config is not None and self.output_config.format is not None:
            schema = self.output_config.format.schema_
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": schema},
            }
        effort = self.output_config.effort if self.output_config is not None else None
        if isinstance(self.thinking, ThinkingDisabled):
            effort = "none"
        if effort is not None:
            fields["reasoning_effort"] = effort
        return fields


class MessagesRequest(MessagesInput):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    # Left out: the model's generation config, else 1.0 (Anthropic's default, and chat's).
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    stream: bool = False
    metadata: Metadata | None = None

    @model_validator(mode="after")
    def _budget_within_max_tokens(self) -> MessagesRequest:
        thinking = self.thinking
        if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, stops: list[str] | None) -> list[str] | None:
        if stops is not None and not all(stops):
            raise ValueError("every stop sequence must be a non-empty string")
        return stops

    def chat_fields(self) -> dict[str, Any]:
        fields = super().chat_fields()
        fields.update(max_tokens=self.max_tokens)
        optional = {
            "temperature": self.temperature,
            "stop": self.stop_sequences,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "user": self.metadata.user_id if self.metadata else None,
        }
        fields.update({name: value for name, value in optional.items() if value is not None})
        return fields


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(block.text for block in blocks)


def _chat_messages(
    system: str | list[TextBlock] | None, messages: list[InputMessage]
) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    if system:
        chat.append(
            {"role": "system", "content": system if isinstance(system, str) else _joined(system)}
        )
    for message in messages:
        if message.role == "assistant":
            chat.append(_assistant_message(message))
            continue
        parts: list[dict[str, Any]] = []
        for block in message.blocks:
            if isinstance(block, TextBlock):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlock):
                parts.append(block.chat_part())
            elif isinstance(block, ToolResultBlock):
                if parts:
                    chat.append({"role": message.role, "content": _chat_content(parts)})
                    parts = []
                chat.append(
                    {"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
                )
        if parts or not message.blocks:
            chat.append({"role": message.role, "content": _chat_content(parts)})
    return chat


def _chat_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text alone as one string (joined by newlines, as chat joins text parts); with
    images, the parts in order."""
    if all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    return parts


def _as_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content}] if content else []


def _assistant_message(message: InputMessage) -> dict[str, Any]:
    texts = [block.text for block in message.blocks if isinstance(block, TextBlock)]
    calls = [
        {
            "id": block.id,
            "type": "function",
            "function": {"name": block.name, "arguments": json.dumps(block.input)},
        }
        for block in message.blocks
        if isinstance(block, ToolUseBlock)
    ]
    entry: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        entry["tool_calls"] = calls
    thoughts = [block.thinking for block in message.blocks if isinstance(block, ThinkingBlock)]
    if thoughts:
        entry["reasoning"] = "".join(thoughts)
    return entry


def _merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user (or assistant) turns as one, their texts joined by newlines; the
    calls of merged assistant turns in order. An empty final assistant turn is dropped:
    there is nothing to continue."""
    merged: list[dict[str, Any]] = []
    for message in messages:
        previous = merged[-1] if merged else None
        same_turn = previous is not None and previous["role"] == message["role"]
        if same_turn and message["role"] in ("user", "assistant"):
            if isinstance(previous["content"], list) or isinstance(message["content"], list):
                previous["content"] = _as_parts(previous["content"]) + _as_parts(message["content"])
            else:
                texts = [t for t in (previous["content"], message["content"]) if t]
                previous["content"] = "\n".join(texts)
            calls = previous.get("tool_calls", []) + message.get("tool_calls", [])
            if calls:
                previous["tool_calls"] = calls
            thoughts = [t for t in (previous.get("reasoning"), message.get("reasoning")) if t]
            if thoughts:
                previous["reasoning"] = "".join(thoughts)
        else:
            merged.append(dict(message))
    last = merged[-1]
    if len(merged) > 1 and last["role"] == "assistant" and not last["content"]:
        merged.pop()
    return merged


def _chat_tool_choice(choice: Any) -> dict[str, Any]:
    """The chat path's `tool_choice` and `parallel_tool_calls` for Anthropic's choice."""
    if choice is None:
        return {}  # "auto", as on both APIs
    fields: dict[str, Any] = {}
    if isinstance(choice, ToolChoiceNone):
        fields["tool_choice"] = "none"
    elif isinstance(choice, ToolChoiceAuto):
        fields["tool_choice"] = "auto"
    elif isinstance(choice, ToolChoiceAny):
        fields["tool_choice"] = "required"
    else:
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    if not isinstance(choice, ToolChoiceNone):
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields
