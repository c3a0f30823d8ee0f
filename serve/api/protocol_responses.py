"""OpenAI's Responses API request (POST /v1/responses), validated at the door.

What this server cannot honour is refused by name with a 400 rather than ignored: file
and audio input (images by `file_id`: there is no Files API; `input_image` by URL goes to
the chat path, which refuses it for a model that takes no images), built-in tools (web search, file search, computer use, ...), item
kinds other than messages, function calls and reasoning, encrypted reasoning, background
runs, conversations and prompt templates. Unknown fields are accepted and ignored, as on
the other endpoints; vLLM's sampling extras (`top_k`, `seed`, `stop`, ...) pass through to
the chat request that runs the response (`SAMPLING_EXTRAS`). `reasoning.effort` reaches the
chat template as vLLM hands it over (`reasoning_effort`, and `enable_thinking`), with or
without a reasoning parser; a summary is not written (vLLM writes none either).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from serve.api.protocol import FunctionDefinition, OpenAIModel

# Fields of the chat request a Responses request may also set, as vLLM's extras.
SAMPLING_EXTRAS = frozenset(
    {
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_tokens",
        "bad_words",
        "allowed_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "priority",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "chat_template_kwargs",
    }
)
CONTENT_PARTS = ("input_text", "input_image", "output_text", "refusal")
ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA_PAIRS = 16  # OpenAI's bounds: 16 pairs, keys of 64 and values of 512 chars
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def _refuse_unsupported(values: Any, field: str, supported: tuple[str, ...], why: str) -> Any:
    """A ValueError naming the first entry of a list whose `type` is not `supported`."""
    if not isinstance(values, list):
        return values
    for index, value in enumerate(values):
        kind = value.get("type", supported[0]) if isinstance(value, dict) else None
        if isinstance(kind, str) and kind not in supported:
            raise ValueError(f"{field}[{index}] has type {kind!r}, which {why}")
    return values


class ContentPart(OpenAIModel):
    """A part of a message: `input_text` or `input_image` (by URL: http(s) or a data URL),
    or `output_text` / `refusal` in assistant turns sent back."""

    type: Literal["input_text", "input_image", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None

    @model_validator(mode="after")
    def _has_its_text(self) -> ContentPart:
        if self.type == "input_image":
            if self.image_url is None:
                why = "no Files API here: send image_url" if self.file_id else "need image_url"
                raise PydanticCustomError("missing", f"input_image parts {why}")
            return self
        key = "refusal" if self.type == "refusal" else "text"
        if getattr(self, key) is None:
            raise PydanticCustomError("missing", f"{self.type} parts need {key}")
        return self

    @property
    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


def _supported_parts(parts: Any) -> Any:
    return _refuse_unsupported(
        parts,
        "content",
        CONTENT_PARTS,
        "this server does not read (input_text and input_image parts; output_text and "
        "refusal in assistant turns)",
    )


def chat_content(content: str | list[ContentPart]) -> str | list[dict[str, Any]]:
    """Content as a chat message holds it: text parts (joined as chat joins them), and
    images as chat's `image_url` parts."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        if part.type == "input_image":
            image: dict[str, Any] = {"url": part.image_url}
            if part.detail is not None:
                image["detail"] = part.detail
            parts.append({"type": "image_url", "image_url": image})
        else:
            parts.append({"type": "text", "text": part.value})
    return parts


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]

    _parts = field_validator("content", mode="before")(_supported_parts)


class FunctionCallItem(OpenAIModel):
    """A call the model made (an output item sent back), which a function_call_output
    answers by its `call_id`."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # a JSON object as text; any text is taken (see protocol.FunctionCall)


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]

    _parts = field_validator("output", mode="before")(_supported_parts)


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(OpenAIModel):
    """A reasoning model's thinking (an output item sent back): the assistant turn's
    `reasoning` in the chat, as vLLM reads it (its text, else its summary's)."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _not_encrypted(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError(
                "encrypted reasoning is not supported: send the reasoning's content as text"
            )
        return v

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


def _item_kind(item: Any) -> str:
    """An input item's kind: its `type`, "message" when it has none (EasyInputMessage)."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if kind in ITEM_KINDS else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(FunctionDefinition):
    """A function tool: the chat tool's function, flattened (`type` beside `name`)."""

    type: Literal["function"]


class FunctionToolChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError('type "json_schema" needs a name and a schema')
        return self


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("verbosity")
    @classmethod
    def _medium_only(cls, v: str | None) -> str | None:
        if v not in (None, "medium"):
            raise ValueError(
                f"{v!r} is not supported: the model's answers are as long as it writes them"
            )
        return v


class ReasoningConfig(OpenAIModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None  # a system message first; not carried to a continuation
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool = True
    # vLLM's: with --reasoning-parser, false leaves the reasoning item out (and the
    # output's logprobs), as vLLM does.
    include_reasoning: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Accepted and echoed; they change nothing here.
    max_tool_calls: int | None = Field(default=None, ge=1)
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    reasoning: ReasoningConfig | None = None  # its effort reaches the template
    # Refused unless off: what this server cannot do.
    background: bool = False
    truncation: Literal["auto", "disabled"] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _supported_items(cls, items: Any) -> Any:
        if isinstance(items, list) and not items:
            raise ValueError("must not be an empty list")
        return _refuse_unsupported(
            items,
            "input",
            ITEM_KINDS,
            f"this server does not take: it takes {', '.join(ITEM_KINDS)} items",
        )

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: Any) -> Any:
        return _refuse_unsupported(
            tools,
            "tools",
            ("function",),
            "this server does not run: it has no built-in tools, only functions "
            '(type "function") that the client runs',
        )

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[FunctionTool] | None) -> list[FunctionTool] | None:
        names = [tool.name for tool in tools or []]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"function names must be unique; repeated: {repeated}")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, choice: Any) -> Any:
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise ValueError(
                f"of type {choice.get('type')!r} is not supported: give none, auto, required "
                'or {"type": "function", "name": ...}'
            )
        return choice

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_PAIRS:
            raise ValueError(f"has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS}")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(
                    f"keys are at most {MAX_METADATA_KEY_CHARS} characters and values at "
                    f"most {MAX_METADATA_VALUE_CHARS}; {key[:MAX_METADATA_KEY_CHARS]!r} is not"
                )
        return metadata

    @field_validator("background")
    @classmethod
    def _not_background(cls, v: bool) -> bool:
        if v:
            raise ValueError("background responses are not supported; stream, or wait for it")
        return v

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, v: str | None) -> str | None:
        if v == "auto":
            raise ValueError(
                '"auto" is not supported: an input longer than the context window is '
                'refused ("disabled"); shorten it'
            )
        return v

    @field_validator("conversation", "prompt")
    @classmethod
    def _not_supported(cls, v: Any, info: Any) -> Any:
        if v is not None:
            what = {"conversation": "conversations", "prompt": "stored prompt templates"}
            raise ValueError(
                f"{what[info.field_name]} are not supported; continue a conversation "
                "with previous_response_id"
            )
        return v

    @property
    def input_items(
        self,
    ) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.top_logprobs) or LOGPROBS_INCLUDE in (self.include or [])

    @property
    def text_format(self) -> TextFormat:
        if self.text is None or self.text.format is None:
            return TextFormat(type="text")
        return self.text.format

    @property
    def unknown_fields(self) -> list[str]:
        return [name for name in super().unknown_fields if name not in SAMPLING_EXTRAS]

    @property
    def sampling_extras(self) -> dict[str, Any]:
        return {k: v for k, v in (self.model_extra or {}).items() if k in SAMPLING_EXTRAS}
