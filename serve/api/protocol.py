"""OpenAI request and response shapes (pydantic), validated at the door.

Unknown fields are accepted and ignored, as OpenAI's own clients and many tools send
fields a server may not know; known fields with wrong types or values fail with a 400.
Limits the server sets (--max-n, --max-stop-sequences, ...) are checked against its
settings (request_checks.check_limits), not here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from serve.chat.rendering import RENDERING_ARGUMENTS
from serve.chat.tool_parsers.forced import named_function_schema, required_tool_calls_schema
from serve.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from serve.structured_outputs import (
    REFUSED_OPTIONS,
    StructuredOutputsParams,
    unenforceable_json_schema,
)

MAX_LENGTH_PENALTY = 10.0


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# A client's own request id (X-Request-Id, vLLM's `request_id` field) when it is this plain.
CLIENT_REQUEST_ID = r"[A-Za-z0-9._:/+=-]{1,128}"


def response_ids(prefix: str, client_id: str | None) -> tuple[str, str]:
    """A response's id and its engine request's. With the client's own id the response is
    `{prefix}-{client_id}`, as vLLM names it; the engine's id adds a random suffix, since a
    client may reuse its id while an earlier request with it still runs."""
    if client_id is None:
        response_id = random_id(prefix)
        return response_id, response_id
    response_id = f"{prefix}-{client_id}"
    return response_id, f"{response_id}-{uuid.uuid4().hex[:8]}"


class OpenAIModel(BaseModel):
    # NaN and infinity are not JSON, though Python's parser reads them (and 1e999 as inf).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        """A field sent as null takes its default, as OpenAI's nullable fields do: the SDKs
        send null for a parameter passed as None (`temperature=config.temperature`). It
        counts as not given (`model_fields_set`), so the model's sampling defaults apply."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    # vLLM's extra: with include_usage, every chunk carries its choice's usage so far.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, value: Any) -> Any:
        if value == "structural_tag":  # vLLM's; a clearer word than the Literal's
            raise ValueError(f"structural_tag {REFUSED_OPTIONS['structural_tag']}")
        return value

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object with a schema')
        return self


def enforceable(schema: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
    """`schema` if the grammar engine can hold output to it; a ValueError naming the
    keyword it would ignore if not."""
    problem = None if schema is None else unenforceable_json_schema(schema)
    if problem is not None:
        raise ValueError(problem)
    return schema


def non_empty(choice: list[str] | None) -> list[str] | None:
    if choice is not None and not choice:
        raise ValueError("must be a non-empty list of strings")
    return choice


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs`: one constraint (json, regex, choice, grammar or
    json_object) with vLLM's options, as StructuredOutputsParams holds them. A key serve
    does not know is refused, not ignored: ignored, it would leave the output free."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        # "_"-prefixed keys are vLLM's private dataclass fields (dataclasses.asdict has them).
        if not isinstance(data, dict):
            return data
        known = {field.alias or name for name, field in cls.model_fields.items()}
        unknown = [k for k in data if k not in known and not str(k).startswith("_")]
        if unknown:
            raise ValueError(
                f"{unknown[0]!r} is not a structured_outputs key: give one of json, regex, "
                "choice, grammar or json_object"
            )
        return data

    _json = field_validator("json_")(enforceable)
    _choice = field_validator("choice")(non_empty)

    @field_validator("structural_tag", "whitespace_pattern")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        raise ValueError(REFUSED_OPTIONS[info.field_name])

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "give exactly one of json, regex, choice, grammar or json_object; got "
                + (" and ".join(name.rstrip("_") for name in given) or "none")
            )
        return self

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_,
            json_object=bool(self.json_object),
            regex=self.regex,
            choice=tuple(self.choice) if self.choice is not None else None,
            grammar=self.grammar,
            disable_any_whitespace=self.disable_any_whitespace,
            disable_additional_properties=self.disable_additional_properties,
        )


# The fields that constrain the output, at most one a request (a `response_format` of type
# "text" constrains nothing).
FORMAT_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


def constrains(value: Any) -> bool:
    return value is not None and not (isinstance(value, ResponseFormat) and value.type == "text")


# vLLM's extras, on every request that takes a prompt. A priority is a 64-bit integer, as
# in vLLM; truncate_prompt_tokens keeps the prompt's last N tokens (-1: the context's worth).
Priority = Field(default=0, ge=-(2**63), le=2**63 - 1)
TruncatePromptTokens = Field(default=None, ge=-1)


# vLLM's and OpenAI's request fields that serve cannot honour, and why: given, they are a
# 400 (vLLM or OpenAI acts on them; ignored, they would change what the client gets
# without a word).
_FUNCTIONS = (
    "is OpenAI's deprecated function calling, which this server does not take: give the "
    'functions as tools (each {"type": "function", "function": {...}}) and function_call '
    "as tool_choice."
)
_AUDIO_OUT = "asks for audio output, which this server cannot give (its models write text): "
UNHONOURED = {
    "guided_whitespace_pattern": REFUSED_OPTIONS["whitespace_pattern"],
    "logits_processors": "is not supported by this server: it loads no custom logits "
    "processors (its own controls: logit_bias, allowed_token_ids, bad_words, min_tokens, "
    "the penalties, structured_outputs).",
    "prompt_embeds": "is not supported by this server (vLLM's --enable-prompt-embeds): "
    "give the prompt as text or token ids.",
    "functions": _FUNCTIONS,
    "function_call": _FUNCTIONS,
    "modalities": _AUDIO_OUT + 'leave it out, or set it to ["text"].',
    "audio": _AUDIO_OUT + "leave it out.",
    "web_search_options": "asks for a web search, which this server cannot run (it has no "
    "built-in tools): leave it out, or give a function in tools that the client runs.",
}


def refuse_unhonoured(value: Any, info: ValidationInfo) -> Any:
    if value in ([], {}, ""):  # asks for nothing: nothing to honour
        return None
    raise ValueError(UNHONOURED[info.field_name])


class SamplingRequest(OpenAIModel):
    """Fields shared by chat and completions."""

    model: str | None = None
    # vLLM's: the response's id is `chatcmpl-` / `cmpl-` and this (an X-Request-Id header
    # takes its place); without either, a random one.
    request_id: str | None = Field(default=None, pattern=f"^{CLIENT_REQUEST_ID}$")
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    # vLLM's extras: sample best_of, return the n most likely; or beam search of width
    # best_of (default n) ranked as HF transformers ranks beams.
    best_of: int | None = Field(default=None, ge=1)
    use_beam_search: bool = False
    # Beam scores divide by output_len ** length_penalty, which must stay a finite,
    # non-zero float for any output length: HF's useful values are around 0 to 2.
    length_penalty: float = Field(default=1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    early_stopping: bool | Literal["never"] = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # vLLM's extra: keep the stop string, or the text of the stop token, in the output.
    include_stop_str_in_output: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are strings) -> bias
    min_tokens: int = Field(default=0, ge=0)
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0)
    response_format: ResponseFormat | None = None
    # vLLM's structured-output extras: `structured_outputs` (vLLM 0.32's) or its older
    # guided_* fields; at most one of these and response_format.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's fields this server cannot honour: a 400 by name (UNHONOURED), not ignored.
    guided_whitespace_pattern: Any = None
    logits_processors: Any = None
    # vLLM's: logprobs name tokens "token_id:N"; None: the server's --return-tokens-as-token-ids.
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the prompt's and each choice's token ids beside the text (streamed: each
    # chunk's new ones, the prompt's on the first).
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra: with --scheduling-policy priority, lower runs first.
    priority: int = Priority
    truncate_prompt_tokens: int | None = TruncatePromptTokens

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"values must be in [-100, 100], got {bias} for token {key}")
        return v

    @field_validator("response_format")
    @classmethod
    def _enforceable_format(cls, fmt: ResponseFormat) -> ResponseFormat:
        if fmt.type == "json_schema" and fmt.json_schema is not None:
            enforceable(fmt.json_schema.schema_)
        return fmt

    _guided_json = field_validator("guided_json")(enforceable)
    _unhonoured = field_validator("guided_whitespace_pattern", "logits_processors")(
        refuse_unhonoured
    )
    _guided_choice = field_validator("guided_choice")(non_empty)

    @field_validator(*FORMAT_FIELDS[1:])
    @classmethod
    def _one_structured_output(cls, value: Any, info: ValidationInfo) -> Any:
        earlier = FORMAT_FIELDS[: FORMAT_FIELDS.index(info.field_name)]
        given = next((name for name in earlier if constrains(info.data.get(name))), None)
        if given is not None:
            raise ValueError(
                "give at most one of response_format, structured_outputs and the guided_* "
                f"fields; {given} is given too"
            )
        return value

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The grammar the output must follow, from whichever field sets one (validation
        let one at most through)."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.schema_ if fmt.json_schema else None
            return StructuredOutputsParams(json=schema or {})
        if self.guided_json is not None:
            return StructuredOutputsParams(json=self.guided_json)
        if self.guided_regex is not None:
            return StructuredOutputsParams(regex=self.guided_regex)
        if self.guided_choice is not None:
            return StructuredOutputsParams(choice=tuple(self.guided_choice))
        if self.guided_grammar is not None:
            return StructuredOutputsParams(grammar=self.guided_grammar)
        if self.structured_outputs is not None:
            return self.structured_outputs.params()
        return None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def tokens_as_ids(self, server_default: bool) -> bool:
        asked = self.return_tokens_as_token_ids
        return server_default if asked is None else asked

    def usage_in_stream(self, forced: bool = False) -> tuple[bool, bool]:
        """Whether a stream ends with a usage chunk, and whether every chunk carries its
        choice's usage so far (vLLM's `continuous_usage_stats`, which needs the first).
        `forced` (--enable-force-include-usage): both, whatever the request asks."""
        if forced:
            return True, True
        options = self.stream_options
        if options is None or not options.include_usage:
            return False, False
        return True, options.continuous_usage_stats

    @model_validator(mode="after")
    def _best_of(self) -> SamplingRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.stream and not self.use_beam_search and (self.best_of or self.n) > self.n:
            raise ValueError("best_of greater than n cannot be streamed; set stream to false")
        return self

    def sampling_params(
        self,
        max_tokens: int,
        num_logprobs: int | None,
        defaults: Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        """The engine's params: n samples (sample i seeded seed + i) or n beams. `defaults`
        (the model's generation config) stand in for the sampling fields the request
        leaves out."""
        given, defaults = self.model_fields_set, defaults or {}
        chosen = {
            name: defaults[name] if name in defaults and name not in given else getattr(self, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        }
        if self.use_beam_search and "temperature" not in given:
            chosen["temperature"] = 0.0  # beam search is deterministic
        return SamplingParams(
            n=self.n,
            best_of=self.best_of,
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            temperature=chosen["temperature"],
            top_p=chosen["top_p"],
            top_k=chosen["top_k"],
            min_p=chosen["min_p"],
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=num_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=chosen["repetition_penalty"],
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            min_tokens=self.min_tokens,
            bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids,
            prompt_logprobs=self.num_prompt_logprobs,
            structured_outputs=self.structured_outputs_params(),
        )


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class RefusalPart(OpenAIModel):
    """An assistant's refusal, as OpenAI returns it; rendered as its text."""

    type: Literal["refusal"]
    refusal: str


class ImageURL(OpenAIModel):
    url: str = Field(min_length=1)  # data:image/...;base64,..., http(s)://, file://
    # OpenAI's "auto", "low", "high": taken and ignored, as vLLM ignores it (an image
    # becomes the tokens its model's image processor makes of it).
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(OpenAIModel):
    """An image by its URL (serve/engine/media.py reads it), for a model that takes
    images. vLLM's short form, `{"image_url": "<url>"}` with no type, is taken too."""

    type: Literal["image_url"] = "image_url"
    image_url: ImageURL | str

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


def _part_kind(part: Any) -> str:
    # Any type but "refusal" and "image_url" is checked as a text part, so that an unknown
    # one is refused at `content.N.type`.
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    if kind is None and isinstance(part, dict) and "image_url" in part:
        return "image_url"  # vLLM's short form
    return kind if kind in ("refusal", "image_url") else "text"


ContentPart = Annotated[
    Annotated[TextPart, Tag("text")]
    | Annotated[RefusalPart, Tag("refusal")]
    | Annotated[ImageURLPart, Tag("image_url")],
    Discriminator(_part_kind),
]


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type "object"
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # Without a type it is read as an object, as vLLM reads it (`object_parameters`).
        if v and v.get("type", "object") != "object":
            raise ValueError('must be a JSON schema of type "object" (arguments are named)')
        return v

    @property
    def object_parameters(self) -> dict[str, Any] | None:
        """The parameters' schema with its type: a schema written without one is an
        object's (a grammar would read it as any JSON value)."""
        if self.parameters and "type" not in self.parameters:
            return {"type": "object", **self.parameters}
        return self.parameters


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(OpenAIModel):
    name: str
    # A JSON object as text, but any text is taken, as OpenAI takes it: a call cut short by
    # max_tokens comes back in the history as it was returned (rendered with empty
    # arguments: chat/rendering.py).
    arguments: str


class MessageToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    # OpenAI's roles ("function": its deprecated function result, which vLLM renders as
    # that role); not any other name, as OpenAI refuses them too.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    tool_calls: list[MessageToolCall] | None = None  # assistant messages only
    # An assistant's refusal, as OpenAI returns it beside null content: it becomes a
    # refusal part at the end of the content (`_refusal_as_part`), rendered as its text.
    refusal: str | None = None
    # vLLM's: an assistant's reasoning (its thinking before the answer), handed to the
    # template as `reasoning` and `reasoning_content` (Qwen3's reads the latter); vLLM's
    # older name `reasoning_content` is taken for it.
    reasoning: str | None = None
    # Checked even when absent (validate_default): only an assistant message with calls, a
    # refusal or reasoning (and OpenAI's function message) may leave it out. After role,
    # tool_calls, refusal and reasoning, which its check reads.
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    name: str | None = None  # required in a function message: the function's name
    tool_call_id: str | None = None  # tool messages: the call they answer

    @property
    def text(self) -> str:
        """The content as text: its parts' texts (a refusal's included, images left out)
        joined by newlines."""
        if isinstance(self.content, list):
            return "\n".join(
                p.text if isinstance(p, TextPart) else p.refusal
                for p in self.content
                if not isinstance(p, ImageURLPart)
            )
        return self.content or ""

    @property
    def image_urls(self) -> list[str]:
        """The URLs of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [p.url for p in self.content if isinstance(p, ImageURLPart)]

    @field_validator("content")
    @classmethod
    def _content_given(cls, content: Any, info: ValidationInfo) -> Any:
        if content is not None or not {"role", "tool_calls"} <= info.data.keys():
            return content  # given, or the message is invalid already
        if info.data["role"] == "function":
            return content  # OpenAI's function message may have null content
        if info.data["role"] != "assistant":
            raise PydanticCustomError("missing", f"a {info.data['role']} message needs content")
        if not info.data.get("tool_calls") and info.data.get("refusal") is None:
            if info.data.get("reasoning") is None:
                raise PydanticCustomError(
                    "missing", "an assistant message needs content, tool_calls or a refusal"
                )
        return content

    @model_validator(mode="before")
    @classmethod
    def _reasoning_content(cls, data: Any) -> Any:
        """`reasoning_content` is `reasoning` (vLLM renames it; `reasoning` wins)."""
        if isinstance(data, dict) and "reasoning_content" in data:
            data = dict(data)
            reasoning = data.pop("reasoning_content")
            if data.get("reasoning") is None:
                data["reasoning"] = reasoning
        return data

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError('a "tool" message needs the tool_call_id of the call it answers')
        if self.role == "function" and not self.name:
            raise ValueError('a "function" message needs the name of the function it answers')
        if self.role != "assistant" and self.refusal is not None:
            raise ValueError("only assistant messages have a refusal")
        if self.role != "assistant" and isinstance(self.content, list):
            if any(isinstance(part, RefusalPart) for part in self.content):
                raise ValueError("only assistant messages have refusal content parts")
        return self

    @model_validator(mode="after")
    def _refusal_as_part(self) -> ChatMessage:
        """A message-level refusal moved to the content's end, as a refusal part, so that
        the content alone says what the template renders."""
        if self.refusal is not None:
            given = self.content
            parts = [TextPart(type="text", text=given)] if isinstance(given, str) and given else []
            parts += given if isinstance(given, list) else []
            self.content = [*parts, RefusalPart(type="refusal", refusal=self.refusal)]
            self.refusal = None
        return self


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    # vLLM's extra: the final message stays open and the model continues it ("prefill");
    # add_generation_prompt must then be false.
    continue_final_message: bool = False
    # vLLM's extra: each choice's content starts with the last message's text when that
    # message has the reply's role (the turn the model continues).
    echo: bool = False
    chat_template: str | None = None
    # vLLM's extra: more variables for the chat template (e.g. Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's extra: the image processor's keyword arguments for this request's images,
    # over --mm-processor-kwargs (Qwen2-VL's max_pixels).
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    # Default: "auto" when tools are given, else "none" (see `effective_tool_choice`).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Reasoning models: the template's `reasoning_effort` (and, unless chat_template_kwargs
    # set it, `enable_thinking`: false for "none"), as vLLM hands them over; with
    # --reasoning-parser, include_reasoning false leaves the reasoning out of the reply
    # (and the tokens' logprobs and ids with it), as vLLM does.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    include_reasoning: bool = True
    # OpenAI's fields this server cannot honour: a 400 by name (UNHONOURED), not ignored.
    # (`prediction`, Predicted Outputs, changes only the latency: it is left unknown.)
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None

    _unhonoured_openai = field_validator("functions", "audio", "web_search_options")(
        refuse_unhonoured
    )

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any, info: ValidationInfo) -> Any:
        return None if value == "none" else refuse_unhonoured(value, info)

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, list) and all(kind == "text" for kind in value):
            return None
        return refuse_unhonoured(value, info)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _continue_or_prompt(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true: set "
                "add_generation_prompt to false to continue the final message"
            )
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(kwargs or {}) & RENDERING_ARGUMENTS)
        if reserved:
            raise ValueError(
                f"{reserved} are set by the request's own fields, not as template variables"
            )
        return kwargs

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: list[ChatTool] | None) -> list[ChatTool] | None:
        if tools == []:  # OpenAI's and vLLM's rule
            raise ValueError("must not be an empty array: give at least one tool, or leave it out")
        names = [tool.function.name for tool in tools or []]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"function names must be unique; repeated: {repeated}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        if "tools" not in info.data:
            return choice  # the tools are invalid, and reported as such
        names = [tool.function.name for tool in info.data["tools"] or []]
        if choice not in (None, "none") and not names:
            raise ValueError("is only allowed when tools are given")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"names the function {choice.function.name!r}, which is not among the tools "
                f"({', '.join(names)})"
            )
        if choice not in (None, "none", "auto"):
            _check_forced_format(choice, info.data)
        return choice

    @property
    def effective_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """Tool choice "required" or a named function constrains the output to a JSON
        schema (see tool_parsers/forced.py), as vLLM does; else what the parent finds."""
        choice = self.effective_tool_choice
        if choice in ("none", "auto"):
            return super().structured_outputs_params()
        functions = _forced_functions(self.tools or [], choice)
        if choice == "required":
            schema = required_tool_calls_schema(functions, self.parallel_tool_calls)
        else:
            schema = named_function_schema(functions[choice.function.name])
        return StructuredOutputsParams(json=schema)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def image_urls(self) -> list[str]:
        """Its messages' image URLs, in the order their placeholders take in the prompt."""
        return [url for message in self.messages for url in message.image_urls]


def _forced_functions(
    tools: list[ChatTool], choice: Literal["required"] | NamedToolChoice
) -> dict[str, dict[str, Any] | None]:
    """The parameters of the functions a forced tool choice may call, by name."""
    return {
        tool.function.name: tool.function.object_parameters
        for tool in tools
        if choice == "required" or tool.function.name == choice.function.name
    }


def _check_forced_format(choice: Literal["required"] | NamedToolChoice, fields: dict) -> None:
    """A forced tool choice sets the output's format itself: a ValueError if another field
    sets one too, or a function's parameters are a schema the grammar cannot enforce."""
    given = next((name for name in FORMAT_FIELDS if constrains(fields.get(name))), None)
    if given is not None:
        raise ValueError(
            f'"required" or a named function sets the output\'s format itself; it cannot be '
            f"combined with {given}"
        )
    tools: list[ChatTool] = fields["tools"] or []
    functions = _forced_functions(tools, choice)
    for index, tool in enumerate(tools):
        problem = unenforceable_json_schema(functions.get(tool.function.name) or {})
        if problem is not None:
            raise ValueError(
                f"forces a call of {tool.function.name!r}, whose parameters "
                f"(tools.{index}.function.parameters) cannot be enforced. {problem}"
            )
    if choice == "required":
        required_tool_calls_schema(functions, True)  # two functions' $defs may clash


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    prompt_embeds: Any = None  # vLLM's (with --enable-prompt-embeds); refused (UNHONOURED)
    # 0 with `echo` scores the prompt (its logprobs) without sampling, as OpenAI's legacy
    # API allowed; 0 without echo is refused (serving_completion.py).
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    suffix: str | None = None

    _unhonoured_prompt = field_validator("prompt_embeds")(refuse_unhonoured)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if "max_tokens" in self.model_fields_set else 16

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """`echo` with `logprobs` reports the prompt's tokens too, as OpenAI's legacy API did."""
        if self.echo and self.logprobs is not None:
            return max(self.prompt_logprobs or 0, self.logprobs)
        return self.prompt_logprobs


class TokenizeRequest(OpenAIModel):
    """A prompt's tokens, or a conversation's as chat renders it (the chat fields that
    shape the prompt count, checked as chat checks them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    # Shapes the prompt too: under --exclude-tools-when-tool-choice-none, "none" leaves
    # the tools out, as chat would (checked by chat's rules).
    tool_choice: Any = None
    mm_processor_kwargs: dict[str, Any] | None = None  # as chat's, for its images' runs
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self

    def chat_fields(self) -> dict[str, Any]:
        names = (
            "model",
            "messages",
            "add_generation_prompt",
            "continue_final_message",
            "chat_template",
            "chat_template_kwargs",
            "tools",
            "tool_choice",
            "mm_processor_kwargs",
        )
        return {name: getattr(self, name) for name in names if name in self.model_fields_set}


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def now() -> int:
    return int(time.time())
