"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat
path.

A request is mapped onto a chat completion request (protocol_anthropic.py), which the
chat handler checks, renders and runs as it would its own: the model name, the server's
limits, the context window, the grammar of forced tool calls and of `output_config`, the
request timeout and the engine's metrics are the chat path's. Here the output becomes
Anthropic's content blocks (text, `tool_use`) and stop reasons, and a stream becomes
Anthropic's events: message_start, ping, per block content_block_start / _delta / _stop,
message_delta (stop reason, output tokens) and message_stop; or an `error` event.

With `--reasoning-parser`, the model's thinking comes first as a `thinking` block, as
vLLM 0.32 sends it: its `signature` a random hex string (nothing signs it, nothing checks
it when it comes back); streamed, `thinking_delta`s, then a `signature_delta` before the
block's content_block_stop. Usage counts it among the output tokens, apart nowhere.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic_core import from_json

from serve.api.errors import APIError
from serve.api.protocol import ChatCompletionRequest
from serve.api.protocol_anthropic import MessagesInput, MessagesRequest, ToolChoiceAuto
from serve.api.request_checks import check_structured_output
from serve.api.serving_chat import ChatHandler, ChatPrompt, chat_request_from
from serve.api.sse import sse
from serve.api.streaming import (
    StreamState,
    UsageCallback,
    choice_outputs,
    final_outputs,
    guard_stream,
    usage,
)
from serve.chat.reasoning_parsers import ReasoningDelta
from serve.chat.tool_parsers import TOOL_PARSERS, StreamEvent, ToolCall, in_written_order
from serve.outputs import CompletionOutput, OutputKind, RequestOutput

MESSAGES_PATH = "/v1/messages"


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call_id: str) -> str:
    """Anthropic's `toolu_` id for a call the tool parsers named `call_...`."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's `input` object from its arguments' JSON text. Arguments cut short by
    max_tokens give the members they completed, as a client parsing the streamed
    `input_json_delta`s gets."""
    try:
        value = from_json(arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(completion: CompletionOutput | None, has_calls: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished output."""
    if completion is not None and completion.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if completion is not None and isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None  # EOS, a stop token, a completed grammar (or an abort)


def sse_event(name: str, payload: dict[str, Any]) -> bytes:
    return sse(payload, event=name)


def signature() -> str:
    """A thinking block's `signature`: vLLM's, a random hex string that signs nothing."""
    return uuid.uuid4().hex


def thinking_block(thinking: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thinking, "signature": signature()}


class ContentBlockEvents:
    """Anthropic's content-block events for one streamed output, from its reasoning and
    the chat path's stream events (text, and tool-call headers and argument fragments): a
    thinking block is open while reasoning comes, a text block while text comes, each
    call is a tool_use block whose input arrives as `input_json_delta`s."""

    def __init__(self) -> None:
        self.index = -1
        self.open_type: str | None = None
        self.num_calls = 0

    def events(self, event: StreamEvent) -> list[str]:
        if isinstance(event, str):
            if not event:
                return []
            started = [] if self.open_type == "text" else self._start({"type": "text", "text": ""})
            return [*started, self._delta({"type": "text_delta", "text": event})]
        started = []
        if event.id is not None:  # a new call
            self.num_calls += 1
            block = {"type": "tool_use", "id": tool_use_id(event.id), "name": event.name}
            started = self._start({**block, "input": {}})
        if not event.arguments:
            return started
        return [
            *started,
            self._delta({"type": "input_json_delta", "partial_json": event.arguments}),
        ]

    def thinking(self, reasoning: str) -> list[str]:
        if not reasoning:
            return []
        start = {"type": "thinking", "thinking": ""}  # vLLM's: no signature until it closes
        started = [] if self.open_type == "thinking" else self._start(start)
        return [*started, self._delta({"type": "thinking_delta", "thinking": reasoning})]

    def close(self) -> list[str]:
        """The open block's content_block_stop, if one is open; a thinking block's
        signature_delta before it."""
        if self.open_type is None:
            return []
        signed = []
        if self.open_type == "thinking":
            signed = [self._delta({"type": "signature_delta", "signature": signature()})]
        self.open_type = None
        stop = {"type": "content_block_stop", "index": self.index}
        return [*signed, sse_event("content_block_stop", stop)]

    def _start(self, block: dict[str, Any]) -> list[str]:
        stopped = self.close()
        self.index += 1
        self.open_type = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*stopped, sse_event("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return sse_event("content_block_delta", body)


@dataclass(frozen=True)
class PreparedMessage:
    chat: ChatCompletionRequest
    prompt: ChatPrompt
    id: str


class MessagesHandler:
    def __init__(self, chat: ChatHandler) -> None:
        self.chat = chat
        self.engine, self.settings = chat.engine, chat.settings

    def chat_request(self, request: MessagesInput, generates: bool = True) -> ChatCompletionRequest:
        """The chat path's request for `request`; a 400 for what that path refuses.
        Without `generates` (a prompt counted, nothing sampled), tools need no parser."""
        stops = getattr(request, "stop_sequences", None) or []
        limit = self.settings.limits.max_stop_sequences
        if len(stops) > limit:
            raise APIError(
                400,
                f"stop_sequences has {len(stops)} entries; this server allows at most {limit} "
                "(--max-stop-sequences).",
                param="stop_sequences",
            )
        auto = request.tool_choice is None or isinstance(request.tool_choice, ToolChoiceAuto)
        if generates and request.tools and auto and self.chat.tool_parser is None:
            raise APIError(
                400,
                'tool_choice "auto" (the default when tools are given) needs a tool-call parser: '
                f"start the server with --tool-call-parser {'|'.join(TOOL_PARSERS)}, or ask for "
                'tool_choice "any", "tool" (with a name) or "none".',
                param="tool_choice",
            )
        fields = request.chat_fields()
        return chat_request_from(fields)

    async def prepare(self, request: MessagesRequest) -> PreparedMessage:
        """Everything that can refuse the request, before a response starts."""
        chat = self.chat_request(request)
        await check_structured_output(self.engine, chat, self.settings.grammar_compile_timeout_s)
        prompt = await self.chat.prepare_with_images(chat)
        return PreparedMessage(chat, prompt, message_id())

    def _generate(
        self, prepared: PreparedMessage, output_kind: OutputKind = OutputKind.DELTA
    ) -> AsyncGenerator[RequestOutput, None]:
        return self.chat.generate(prepared.chat, prepared.id, prepared.prompt, output_kind)

    async def create(
        self, request: MessagesRequest, on_usage: UsageCallback | None = None
    ) -> dict[str, Any]:
        prepared = await self.prepare(request)
        (out,) = await final_outputs([self._generate(prepared, OutputKind.FINAL_ONLY)])
        completion = out.outputs[0]
        reasoning = prepared.prompt.reasoning
        split = reasoning.split(completion.text) if reasoning is not None else None
        text = completion.text if split is None else split.content or ""
        # Blocks in the order written, as the stream sends them.
        pieces = in_written_order(prepared.prompt.output_parser, text)
        content = [
            {"type": "text", "text": piece} if isinstance(piece, str) else _tool_use_block(piece)
            for piece in pieces
        ]
        if split is not None and split.reasoning:
            content.insert(0, thinking_block(split.reasoning))
        has_calls = any(isinstance(piece, ToolCall) for piece in pieces)
        reason, sequence = stop_reason(completion, has_calls)
        num_prompt_tokens = len(prepared.prompt.token_ids)
        if on_usage is not None:
            on_usage(usage(num_prompt_tokens, out.num_output_tokens))
        return {
            **self._message(prepared, content, reason, sequence),
            "usage": {"input_tokens": num_prompt_tokens, "output_tokens": out.num_output_tokens},
        }

    async def stream(
        self, request: MessagesRequest, on_usage: UsageCallback | None = None
    ) -> AsyncIterator[bytes]:
        """The events of a streamed message. Bad requests raise here, before the response
        starts; a failure after that is an `error` event."""
        prepared = await self.prepare(request)
        return self._events(prepared, self._generate(prepared), on_usage)

    async def _events(
        self,
        prepared: PreparedMessage,
        outputs: AsyncGenerator[RequestOutput, None],
        on_usage: UsageCallback | None,
    ) -> AsyncIterator[bytes]:
        num_prompt_tokens = len(prepared.prompt.token_ids)
        start = self._message(prepared, [], None, None)
        start["usage"] = {"input_tokens": num_prompt_tokens, "output_tokens": 0}
        yield sse_event("message_start", {"type": "message_start", "message": start})
        yield sse_event("ping", {"type": "ping"})
        parser, reasoning = prepared.prompt.output_parser, prepared.prompt.reasoning
        reader = parser.stream() if parser is not None else None
        thinking = reasoning.stream() if reasoning is not None else None
        state = StreamState(1)
        blocks = ContentBlockEvents()
        finished: CompletionOutput | None = None
        async with guard_stream(MESSAGES_PATH) as failed:
            async for _, completion in choice_outputs([outputs], 1):
                if finished is not None:
                    continue
                state.take(0, completion)
                text = completion.text
                # Each part's reasoning, then its content, which alone the tool parser reads.
                parts = [thinking.feed(text)] if thinking else [ReasoningDelta(content=text)]
                if completion.finished():
                    finished = completion
                    parts += [thinking.finish()] if thinking else []
                for part in parts:
                    for sse in blocks.thinking(part.reasoning):
                        yield sse
                    events: list[StreamEvent] = (
                        reader.feed(part.content) if reader and part.content else [part.content]
                    )
                    for event in events:
                        for sse in blocks.events(event):
                            yield sse
                for event in reader.finish() if reader and finished else []:
                    for sse in blocks.events(event):
                        yield sse
        if on_usage is not None:
            on_usage(usage(num_prompt_tokens, state.completion_tokens))
        if failed.error is not None:
            yield sse_event("error", failed.error)
            return
        for sse in blocks.close():
            yield sse
        reason, sequence = stop_reason(finished, blocks.num_calls > 0)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        output_usage = {"output_tokens": state.completion_tokens}
        yield sse_event(
            "message_delta", {"type": "message_delta", "delta": delta, "usage": output_usage}
        )
        yield sse_event("message_stop", {"type": "message_stop"})

    async def count_tokens(self, request: MessagesInput) -> dict[str, int]:
        """The prompt's tokens, as /v1/messages would count them in `usage.input_tokens`."""
        self.chat.models.resolve(request.model)
        chat = self.chat_request(request, generates=False)
        return {"input_tokens": len(await self.chat.widened_prompt_ids(chat))}

    def _message(
        self,
        prepared: PreparedMessage,
        content: list[dict[str, Any]],
        reason: str | None,
        sequence: str | None,
    ) -> dict[str, Any]:
        return {
            "id": prepared.id,
            "type": "message",
            "role": "assistant",
            "model": self.chat.models.reply_name(prepared.chat.model),
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
        }


def _tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": tool_use_id(call.id),
        "name": call.name,
        "input": tool_input(call.arguments),
    }
