"""POST /v1/chat/completions, with tool calls read from the output as tool_choice says:
"auto" through the server's `--tool-call-parser`, "required" and named functions from the
JSON their schema forces (tool_parsers/forced.py), "none" not at all. With
`--reasoning-parser`, a reasoning model's thinking is read off first (chat/reasoning_parsers):
messages and deltas carry it as `reasoning` (vLLM 0.32's field), the content and its calls
are what follows it, and a grammar holds only that."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from serve.api.chat_images import load_images, widen_prompt
from serve.api.errors import APIError, validation_message
from serve.api.logprobs_json import (
    prompt_logprobs_json,
    ranked_alternatives,
    token_bytes,
    token_label,
)
from serve.api.protocol import ChatCompletionRequest, NamedToolChoice, now, response_ids
from serve.api.request_checks import (
    PromptCharLimit,
    check_limits,
    check_no_streamed_prompt_logprobs,
    fit_prompt,
    grammar_start,
)
from serve.api.served_models import ServedModels
from serve.api.serving_base import off_the_loop, open_stream
from serve.api.settings import ServerSettings
from serve.api.sse import ChunkWriter
from serve.api.streaming import (
    StreamState,
    UsageCallback,
    final_outputs,
    finish_chunk,
    stream_choices,
    usage,
)
from serve.chat.reasoning_parsers import (
    ReasoningDelta,
    ReasoningParser,
    RequestReasoning,
    reasoning_parser_for,
)
from serve.chat.rendering import ChatRenderError, render_chat
from serve.chat.tool_parsers import (
    TOOL_PARSERS,
    FirstCallOnly,
    NamedFunctionParser,
    OutputParser,
    RequiredParser,
    StreamEvent,
    ToolParser,
    get_tool_parser,
)
from serve.engine.image_inputs import ImageInputs
from serve.engine.protocol import EngineClient
from serve.lora_request import LoRARequest
from serve.multimodal_inputs import MultiModalInput
from serve.outputs import CompletionOutput, OutputKind, RequestOutput


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    token_ids: list[int]
    max_tokens: int
    output_parser: OutputParser | None  # None: the output is all content
    lora: LoRARequest | None = None  # the adapter `model` names; None: the base model
    # With --reasoning-parser: how the output's reasoning is read; None: it is all content.
    reasoning: RequestReasoning | None = None
    # The tokens after which the request's grammar starts (request_checks.grammar_start).
    grammar_start_token_ids: tuple[int, ...] = ()
    mm_inputs: tuple[MultiModalInput, ...] = ()  # its images (token_ids hold their runs)


def tool_finish_reason(
    finish_reason: str | None, has_calls: bool, parser: OutputParser | None
) -> str | None:
    """OpenAI's "tool_calls" for an output that ended with calls the model chose to make
    (tool_choice "auto" or "required"); the call of a function tool_choice names ends
    with "stop", as OpenAI's and vLLM's do. One cut short by its token budget stays
    "length"."""
    chosen = has_calls and not isinstance(parser, NamedFunctionParser)
    return "tool_calls" if chosen and finish_reason == "stop" else finish_reason


def event_fields(
    events: list[StreamEvent], logprobs: Any, reasoning: str = ""
) -> list[dict[str, Any]]:
    """A chunk's choice fields per streamed event, after one for the `reasoning` text;
    the first carries the new tokens' logprobs (an empty delta carries them when
    everything is held back)."""
    chunks = [{"delta": {"reasoning": reasoning}, "logprobs": None}] if reasoning else []
    for event in events:
        if isinstance(event, str):
            delta: dict[str, Any] = {"content": event}
        else:
            delta = {"tool_calls": [event.to_openai()]}
        chunks.append({"delta": delta, "logprobs": None})
    if logprobs is not None:
        if not chunks:
            chunks.append({"delta": {}})
        chunks[0]["logprobs"] = logprobs
    return chunks


def template_tools(request: ChatCompletionRequest, exclude_when_none: bool) -> list[dict[str, Any]]:
    """The request's tools as vLLM hands them to a template (`description` and
    `parameters` null when not given, `strict` only when given, nothing else); none for
    tool_choice "none" under `--exclude-tools-when-tool-choice-none`."""
    if exclude_when_none and request.effective_tool_choice == "none":
        return []
    tools = []
    for tool in request.tools or []:
        f = tool.function
        function = {"name": f.name, "description": f.description, "parameters": f.parameters}
        if f.strict is not None:
            function["strict"] = f.strict
        tools.append({"type": "function", "function": function})
    return tools


def template_kwargs(
    defaults: dict[str, Any], given: dict[str, Any] | None, reasoning_effort: str | None = None
) -> dict[str, Any]:
    """The server's `--default-chat-template-kwargs` under a request's own; a value the
    request leaves null or "auto" keeps the default (vLLM's rule). A `reasoning_effort`
    is the template's too, with `enable_thinking` (false for "none") unless the request's
    own variables set it, as vLLM hands them over."""
    unset = (None, "auto")
    variables = defaults | {
        k: v for k, v in (given or {}).items() if k not in defaults or v not in unset
    }
    if reasoning_effort is not None:
        variables["reasoning_effort"] = reasoning_effort
        if "enable_thinking" not in (given or {}):
            variables["enable_thinking"] = reasoning_effort != "none"
    return variables


def chat_request_from(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request that another endpoint's body maps onto (`fields`, its chat
    fields); a 400 naming the field for what chat refuses."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        message, param = validation_message(e.errors(), fields)
        raise APIError(400, message, param) from None


class ChatHandler:
    def __init__(
        self,
        engine: EngineClient,
        settings: ServerSettings,
        prompt_chars: PromptCharLimit,
        models: ServedModels | None = None,
        images: ImageInputs | None = None,
    ) -> None:
        self.engine, self.settings = engine, settings
        self.tokenizer = engine.tokenizer
        # The images the model takes (None: a text-only model, as a stand-in engine's).
        self.images = images or ImageInputs.text_only(settings.served_model_name)
        self.prompt_chars = prompt_chars
        self.models = models or ServedModels(settings)  # the Responses and Messages ones' too
        name = settings.tool_call_parser
        self.tool_parser: ToolParser | None = get_tool_parser(name) if name else None
        name = settings.reasoning_parser  # ValueError: a tokenizer it cannot read
        self.reasoning_parser: ReasoningParser | None = (
            reasoning_parser_for(name, self.tokenizer) if name else None
        )

    async def prepare_with_images(self, request: ChatCompletionRequest) -> ChatPrompt:
        """`prepare` on the prompt thread, once the request's images are read (off it)."""
        images = await load_images(self.images, request)
        return await off_the_loop(self.prepare, request, images)

    def prepare(
        self, request: ChatCompletionRequest, images: list[Any] | None = None
    ) -> ChatPrompt:
        """The prompt of a chat request whose `images` (PIL, in order) are read already."""
        lora = self.models.resolve(request.model)
        check_limits(request, self.settings)
        if request.stream:
            check_no_streamed_prompt_logprobs(request)
        output_parser = self._output_parser(request)
        text, ids = self.render(request)
        ids, mm_inputs = widen_prompt(self.images, request, ids, images or [])
        text, prompt_ids, max_tokens = fit_prompt(
            text,
            ids,
            request,
            self.tokenizer,
            self.engine.max_model_len,
            self.settings,
        )
        reasoning = None
        if self.reasoning_parser is not None:
            if self.reasoning_parser.keeps_special_tokens:
                # Its markers are special tokens (GPT-OSS's harmony): the output is
                # decoded with them, for the parser alone to read and drop. Set on the
                # request, which the Responses and Messages routes also generate from.
                request.skip_special_tokens = False
            variables = self.template_variables(request)
            reasoning = self.reasoning_parser.for_request(prompt_ids, variables)
            if not request.include_reasoning and request.structured_outputs_params() is not None:
                # Its grammar holds the output from the first token (vLLM's
                # reasoning_ended): no part of that output is reasoning.
                reasoning = dataclasses.replace(reasoning, in_reasoning=False)
        start = grammar_start(reasoning, request)
        return ChatPrompt(
            text, prompt_ids, max_tokens, output_parser, lora, reasoning, start, mm_inputs
        )

    async def prompt_token_ids(self, fields: dict[str, Any]) -> list[int]:
        """The prompt of a chat request made of `fields` (/tokenize's messages form): the
        same checks, rendering and images as chat's (each image's run of tokens, as the
        engine would run it), a 400 for what chat refuses."""
        return await self.widened_prompt_ids(chat_request_from(fields))

    async def widened_prompt_ids(self, request: ChatCompletionRequest) -> list[int]:
        """A request's prompt as the engine would run it, its images read and widened (for
        the token counts of /tokenize and /v1/messages/count_tokens)."""
        images = await load_images(self.images, request)

        def render_and_widen() -> list[int]:
            ids = self.render(request)[1]
            return widen_prompt(self.images, request, ids, images)[0]

        return await off_the_loop(render_and_widen)

    def render(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The prompt's text and token ids: the conversation and its tools through the
        chat template; a request's own template only where the server trusts them."""
        if request.chat_template is not None and not self.settings.trust_request_chat_template:
            raise APIError(
                400,
                "This server renders only its own chat template; a request's chat_template "
                "is refused unless the server was started with --trust-request-chat-template.",
                param="chat_template",
            )
        settings = self.settings
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        try:
            return render_chat(
                self.tokenizer,
                messages,
                request.add_generation_prompt,
                request.chat_template or settings.chat_template,
                template_tools(request, settings.exclude_tools_when_tool_choice_none),
                self.tool_parser,
                lambda text: self.prompt_chars.check(text, "messages"),
                request.continue_final_message,
                self.template_variables(request),
                settings.chat_template_content_format,
                self.images.placeholder_text,
            )
        except ChatRenderError as e:
            raise APIError(400, str(e)) from None

    def template_variables(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """The chat template's variables for `request` (`template_kwargs`)."""
        defaults = self.settings.default_chat_template_kwargs
        return template_kwargs(defaults, request.chat_template_kwargs, request.reasoning_effort)

    def _output_parser(self, request: ChatCompletionRequest) -> OutputParser | None:
        choice = request.effective_tool_choice
        if choice == "none":
            return None
        if choice == "required":
            return RequiredParser()
        if isinstance(choice, NamedToolChoice):
            return NamedFunctionParser(choice.function.name)
        if self.tool_parser is None:
            raise APIError(
                400,
                'tool_choice "auto" (the default when tools are given) needs a tool-call '
                f"parser: start the server with --tool-call-parser {'|'.join(TOOL_PARSERS)}, "
                'or ask for tool_choice "required", a named function, or "none".',
                param="tool_choice",
            )
        return self.tool_parser if request.parallel_tool_calls else FirstCallOnly(self.tool_parser)

    def response_role(self, request: ChatCompletionRequest) -> str:
        """The role a reply's message carries, by vLLM's rule: the server's
        `--response-role` after a generation prompt; without one the model continues the
        last message, so its role."""
        if request.add_generation_prompt:
            return self.settings.response_role
        return request.messages[-1].role

    def echoed(self, request: ChatCompletionRequest) -> str:
        """vLLM's `echo`: the text each choice's content starts with ("" if none)."""
        last = request.messages[-1]
        if not request.echo or last.role != self.response_role(request):
            return ""
        return last.text

    def _message(
        self, prompt: ChatPrompt, completion: CompletionOutput, role: str, with_reasoning: bool
    ) -> tuple[dict[str, Any], str | None]:
        """The choice's message and finish reason. With a reasoning parser, its `reasoning`
        (null without; left out when `with_reasoning` is false) and the content after it,
        from which the calls are read; no answer yet is null content, as vLLM's."""
        parser, reasoning = prompt.output_parser, prompt.reasoning
        split = reasoning.split(completion.text) if reasoning is not None else None
        text = split.content if split is not None else completion.text
        if parser is None:
            message = {"role": role, "content": text}
            reason = completion.finish_reason
        else:
            parsed = parser.parse(text or "")
            message = {"role": role, "content": parsed.content}
            forced = isinstance(parser, (NamedFunctionParser, RequiredParser))
            if parsed.tool_calls:
                message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
            elif parsed.content is None and (reasoning is None or forced):
                message["content"] = ""
            reason = tool_finish_reason(completion.finish_reason, bool(parsed.tool_calls), parser)
        if split is not None:
            message["reasoning"] = split.reasoning if with_reasoning else None
        return message, reason

    def token_logprobs(self, completion: CompletionOutput, num_top: int, as_ids: bool = False):
        """OpenAI's logprobs of the output's tokens (a DELTA output's: the new ones):
        `{"content": [...]}`, or None when the request asked for none. `as_ids`: tokens
        named "token_id:N" (vLLM's return_tokens_as_token_ids), their bytes that text's."""
        if completion.logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = token_label(self.tokenizer, token_id, as_ids)
            held = list(token.encode()) if as_ids else token_bytes(self.tokenizer, token_id, token)
            return {"token": token, "logprob": logprob, "bytes": held}

        content = []
        for token_id, top in zip(completion.token_ids, completion.logprobs):
            ranked = ranked_alternatives(top, num_top)
            content.append(
                {
                    **entry(token_id, top[token_id]),
                    "top_logprobs": [entry(tid, lp) for tid, lp in ranked],
                }
            )
        return {"content": content}

    async def create(
        self, request: ChatCompletionRequest, on_usage: UsageCallback | None = None
    ) -> dict[str, Any]:
        prompt = await self.prepare_with_images(request)
        request_id, engine_id = response_ids("chatcmpl", request.request_id)
        stream = self.generate(request, engine_id, prompt, OutputKind.FINAL_ONLY)
        (out,) = await final_outputs([stream])
        finals = sorted(out.outputs, key=lambda c: c.index)
        choices = []
        role, echoed = self.response_role(request), self.echoed(request)
        reasoning = prompt.reasoning
        # vLLM's: a reply without its reasoning shows no token of it (no logprobs, no ids).
        hides_tokens = reasoning is not None and not request.include_reasoning
        num_reasoning_tokens = 0
        for index, completion in enumerate(finals):
            message, finish_reason = self._message(
                prompt, completion, role, request.include_reasoning
            )
            if echoed:
                message["content"] = echoed + (message["content"] or "")
            if reasoning is not None:
                counter = reasoning.token_counter()
                counter.feed(completion.token_ids)
                num_reasoning_tokens += counter.num_tokens
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": None
                    if hides_tokens
                    else self.token_logprobs(
                        completion,
                        request.top_logprobs or 0,
                        request.tokens_as_ids(self.settings.return_tokens_as_token_ids),
                    ),
                    "finish_reason": finish_reason,
                    "stop_reason": completion.stop_reason,
                }
            )
            if request.return_token_ids and not hides_tokens:
                choices[-1]["token_ids"] = completion.token_ids
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": now(),
            "model": self.models.reply_name(request.model),
            "choices": choices,
            "usage": usage(
                len(prompt.token_ids),
                out.num_output_tokens,
                out.num_cached_tokens or 0 if self.settings.prompt_tokens_details else None,
                num_reasoning_tokens if reasoning is not None else None,
            ),
        }
        if request.return_token_ids:
            body["prompt_token_ids"] = prompt.token_ids
        if request.prompt_logprobs is not None:  # vLLM's extra, beside the choices
            body["prompt_logprobs"] = prompt_logprobs_json(
                self.tokenizer, out, request.prompt_logprobs
            )
        if on_usage is not None:
            on_usage(body["usage"])
        return body

    async def stream(
        self, request: ChatCompletionRequest, on_usage: UsageCallback | None = None
    ) -> AsyncIterator[bytes]:
        """SSE chunks as OpenAI sends them: a role chunk per choice, content and tool-call
        deltas, a finish chunk per choice, the usage chunk if asked for, then [DONE]. Bad
        requests raise here, before the response starts."""
        prompt = await self.prepare_with_images(request)
        response_id, engine_id = response_ids("chatcmpl", request.request_id)
        writer = ChunkWriter(
            response_id,
            "chat.completion.chunk",
            self.models.reply_name(request.model),
            *request.usage_in_stream(self.settings.force_include_usage),
            num_prompt_tokens=(len(prompt.token_ids),),
            n=request.n,
            prompt_token_ids=(
                (prompt.token_ids,)
                if request.return_token_ids
                and (prompt.reasoning is None or request.include_reasoning)
                else None
            ),
            prompt_ids_on_top=True,
        )
        stream = self.generate(request, engine_id, prompt)
        return self._events(request, [stream], writer, prompt, on_usage)

    def generate(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        prompt: ChatPrompt,
        output_kind: OutputKind = OutputKind.DELTA,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine request for a prepared prompt: deltas to stream, or the final output."""
        return open_stream(
            self.engine,
            self.settings,
            request,
            request_id,
            prompt.token_ids,
            prompt.text,
            prompt.max_tokens,
            request.num_logprobs,
            output_kind,
            grammar_start_token_ids=prompt.grammar_start_token_ids,
            lora_request=prompt.lora,
            mm_inputs=prompt.mm_inputs,
        )

    async def _events(
        self,
        request: ChatCompletionRequest,
        streams: list[AsyncIterator[RequestOutput]],
        writer: ChunkWriter,
        prompt: ChatPrompt,
        on_usage: UsageCallback | None,
    ) -> AsyncIterator[bytes]:
        role_name = self.response_role(request)
        for index in range(request.n):
            role = {"role": role_name, "content": ""}
            yield writer.chunk(index, delta=role, logprobs=None, finish_reason=None)
        if echoed := self.echoed(request):
            for index in range(request.n):
                yield writer.chunk(
                    index, delta={"content": echoed}, logprobs=None, finish_reason=None
                )
        num_top = request.top_logprobs or 0
        as_ids = request.tokens_as_ids(self.settings.return_tokens_as_token_ids)
        parser, reasoning = prompt.output_parser, prompt.reasoning
        readers = defaultdict(parser.stream) if parser is not None else None  # per choice
        thinking = defaultdict(reasoning.stream) if reasoning is not None else None
        # vLLM's: a reply without its reasoning shows no token of it (no logprobs, no ids).
        hides_tokens = reasoning is not None and not request.include_reasoning
        state = StreamState(request.n)
        if reasoning is not None:
            state.reasoning_tokens = [reasoning.token_counter() for _ in range(request.n)]

        def fields(index: int, part: ReasoningDelta, logprobs: Any) -> list[dict[str, Any]]:
            thought = part.reasoning if request.include_reasoning else ""
            if readers is None:
                events: list[StreamEvent] = [part.content] if part.content else []
            else:
                events = readers[index].feed(part.content) if part.content else []
            return event_fields(events, logprobs, thought)

        def content(index, completion):
            logprobs = None if hides_tokens else self.token_logprobs(completion, num_top, as_ids)
            if thinking is not None:
                return fields(index, thinking[index].feed(completion.text), logprobs)
            if readers is None:
                return [{"delta": {"content": completion.text}, "logprobs": logprobs}]
            return event_fields(readers[index].feed(completion.text), logprobs)

        def finish(index, completion):
            held_back = []
            if thinking is not None:
                held_back = fields(index, thinking[index].finish(), None)
            if readers is None:
                reason = None
            else:
                reader = readers[index]
                held_back += event_fields(reader.finish(), None)
                reason = tool_finish_reason(completion.finish_reason, reader.num_calls > 0, parser)
            held_back = [{**f, "finish_reason": None} for f in held_back]
            return [*held_back, finish_chunk(completion, reason, delta={})]

        async for event in stream_choices(
            streams,
            request.n,
            writer,
            len(prompt.token_ids),
            content,
            finish,
            on_usage,
            self.settings.prompt_tokens_details,
            state,
        ):
            yield event
