"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A response runs as a chat completion: its conversation (the stored one it continues,
then its input items, after its instructions) becomes a `ChatCompletionRequest`, which
the chat handler prepares as it prepares its own (limits, chat template, tools, the
context window), with the same structured output, reasoning and tool-call readers (the
reasoning, with --reasoning-parser, is an item before the answer's). Errors name the
Responses API's fields (`input`, `max_output_tokens`, `text.format`), not the chat ones.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from serve.api.errors import APIError
from serve.api.protocol import ChatCompletionRequest, now
from serve.api.protocol_responses import ResponsesRequest
from serve.api.request_checks import check_structured_output
from serve.api.response_store import ConversationItem, ResponseStore, StoredResponse
from serve.api.responses_items import (
    chat_messages,
    conversation_items,
    listed_input,
    new_id,
    output_items,
    usage,
)
from serve.api.responses_stream import Event, EventNumbering, StreamedOutput
from serve.api.serving_base import open_stream
from serve.api.serving_chat import ChatHandler, ChatPrompt, chat_request_from
from serve.api.streaming import (
    StreamState,
    UsageCallback,
    choice_outputs,
    final_outputs,
    guard_stream,
)
from serve.api.streaming import usage as chat_usage
from serve.chat.reasoning_parsers import ReasoningDelta, ReasoningTokens
from serve.chat.tool_parsers import in_written_order
from serve.outputs import CompletionOutput, OutputKind, RequestOutput

# The chat request's fields, as this endpoint calls them (first step of a param's path).
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


@dataclass
class Turn:
    """One response being made: its request, the conversation it continues and adds to
    (instructions left out), and the chat request that runs it."""

    request: ResponsesRequest
    conversation: list[ConversationItem]
    chat: ChatCompletionRequest
    previous: StoredResponse | None  # the response it continues
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=now)


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


@contextmanager
def _responses_params() -> Iterator[None]:
    """APIErrors from the chat path, their param (and the message's leading path)
    renamed to this endpoint's fields."""
    try:
        yield
    except APIError as e:
        renamed = _renamed(e.param)
        if e.param is not None and renamed != e.param:
            if e.message.startswith(f"{e.param}: "):
                e.message = f"{renamed}: {e.message[len(e.param) + 2 :]}"
            e.param = renamed
        raise


def _renamed(param: str | None) -> str | None:
    head, dot, rest = (param or "").partition(".")
    if head == "messages":
        return "input"  # message numbers differ from input item numbers
    return _PARAMS[head] + dot + rest if head in _PARAMS else param


class ResponsesHandler:
    def __init__(self, chat: ChatHandler, store: ResponseStore) -> None:
        self.chat, self.store = chat, store
        self.engine, self.settings = chat.engine, chat.settings

    # -- the routes -------------------------------------------------------------------------

    async def create(
        self, request: ResponsesRequest, on_usage: UsageCallback | None = None
    ) -> dict[str, Any]:
        turn, prompt = await self._begin(request)
        (out,) = await final_outputs([self._open(turn, prompt, OutputKind.FINAL_ONLY)])
        completion = out.outputs[0]
        status = _status(completion.finish_reason)
        reasoning = prompt.reasoning
        counter = reasoning.token_counter() if reasoning is not None else None
        logprobs = self._content_logprobs(turn, completion, counter)
        thought, text = None, completion.text
        if reasoning is not None:
            split = reasoning.split(completion.text)
            thought, text = split.reasoning, split.content or ""
        pieces = in_written_order(prompt.output_parser, text)
        shown = thought if turn.request.include_reasoning else None
        output = output_items(pieces, status, logprobs, shown)
        counts = (len(prompt.token_ids), out.num_output_tokens)
        num_reasoning = counter.num_tokens if counter is not None else 0
        counted = usage(*counts, out.num_cached_tokens or 0, num_reasoning)
        body = self._response(turn, status, output, counted)
        self._remember(turn, body)
        if on_usage is not None:
            on_usage(chat_usage(*counts))
        return body

    async def stream(
        self, request: ResponsesRequest, on_usage: UsageCallback | None = None
    ) -> AsyncIterator[bytes]:
        """The response's events (see responses_stream.py), from `response.created` to
        `response.completed` or `response.incomplete`; a failure mid-stream ends it with
        an `error` event and `response.failed`. Bad requests raise here, before the
        response starts."""
        turn, prompt = await self._begin(request)
        return self._events(turn, prompt, self._open(turn, prompt), on_usage)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return stored.body

    def input_items(
        self, response_id: str, after: str | None, limit: int, order: str
    ) -> dict[str, Any]:
        """GET /v1/responses/{id}/input_items: the items the response was made from, its
        chain's earlier inputs and outputs included, newest first unless `order` is asc."""
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be 1 to 100, got {limit}.", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be asc or desc, got {order!r}.", param="order")
        items = list(stored.listed_inputs if order == "asc" else reversed(stored.listed_inputs))
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(404, f"No input item {after!r} in {response_id}.", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # -- preparing a turn ---------------------------------------------------------------------

    async def _begin(self, request: ResponsesRequest) -> tuple[Turn, ChatPrompt]:
        turn = self._turn(request)
        with _responses_params():
            timeout_s = self.settings.grammar_compile_timeout_s
            await check_structured_output(self.engine, turn.chat, timeout_s)
            prompt = await self.chat.prepare_with_images(turn.chat)
        return turn, prompt

    def _turn(self, request: ResponsesRequest) -> Turn:
        stored = None
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
            if stored is None:
                raise _not_found(request.previous_response_id, "previous_response_id")
        previous = stored.conversation if stored is not None else ()
        conversation = [*previous, *request.input_items]
        fields = _chat_fields(request, chat_messages(request.instructions, conversation))
        with _responses_params():
            chat = chat_request_from(fields)
        return Turn(request, conversation, chat, stored)

    def _open(
        self, turn: Turn, prompt: ChatPrompt, output_kind: OutputKind = OutputKind.DELTA
    ) -> AsyncGenerator[RequestOutput, None]:
        with _responses_params():
            return open_stream(
                self.engine,
                self.settings,
                turn.chat,
                turn.id,
                prompt.token_ids,
                prompt.text,
                prompt.max_tokens,
                turn.chat.num_logprobs,
                output_kind,
                grammar_start_token_ids=prompt.grammar_start_token_ids,
                lora_request=prompt.lora,
                mm_inputs=prompt.mm_inputs,
            )

    # -- the response -------------------------------------------------------------------------

    async def _events(
        self,
        turn: Turn,
        prompt: ChatPrompt,
        stream: AsyncGenerator[RequestOutput, None],
        on_usage: UsageCallback | None,
    ) -> AsyncIterator[bytes]:
        events = EventNumbering()
        started = self._response(turn, "in_progress", [], None)
        yield events.sse("response.created", response=started)
        yield events.sse("response.in_progress", response=started)
        output = StreamedOutput()
        parser, reasoning = prompt.output_parser, prompt.reasoning
        reader = parser.stream() if parser is not None else None
        thinking = reasoning.stream() if reasoning is not None else None
        counter = reasoning.token_counter() if reasoning is not None else None
        shows_reasoning = turn.request.include_reasoning

        def read(part: ReasoningDelta, logprobs: list[dict[str, Any]]) -> list[Event]:
            """The events for a piece of the choice: its reasoning, then its content."""
            thought = part.reasoning if shows_reasoning else ""
            emitted = output.reasoning(thought) if thought else []
            text = part.content
            pieces = (reader.feed(text) if reader is not None else [text]) if text else []
            return emitted + output.feed(pieces, logprobs)

        state = StreamState(1)
        status = "completed"
        async with guard_stream() as failed:
            async for _, completion in choice_outputs([stream], 1, state):
                state.take(0, completion)
                text = completion.text
                part = thinking.feed(text) if thinking is not None else ReasoningDelta(content=text)
                logprobs = self._content_logprobs(turn, completion, counter)
                for kind, fields in read(part, logprobs):
                    yield events.sse(kind, **fields)
                if completion.finished():
                    held = thinking.finish() if thinking is not None else ReasoningDelta()
                    finished = read(held, [])
                    if reader is not None:
                        finished += output.feed(reader.finish(), [])
                    for kind, fields in finished:
                        yield events.sse(kind, **fields)
                    status = _status(completion.finish_reason)
        counts = (len(prompt.token_ids), state.completion_tokens)
        num_reasoning = counter.num_tokens if counter is not None else 0
        if on_usage is not None:
            on_usage(chat_usage(*counts))
        if failed.error is not None:
            error = failed.error["error"]
            code = error["code"] or error["type"]
            yield events.sse("error", code=code, message=error["message"], param=error["param"])
            body = self._response(
                turn, "failed", output.items, usage(*counts, state.num_cached_tokens, num_reasoning)
            )
            body["error"] = {"code": "server_error", "message": error["message"]}
            yield events.sse("response.failed", response=body)
            return
        for kind, fields in output.finish(status):
            yield events.sse(kind, **fields)
        counted = usage(*counts, state.num_cached_tokens, num_reasoning)
        body = self._response(turn, status, output.items, counted)
        self._remember(turn, body)  # before the last event: a client may look it up at once
        yield events.sse(f"response.{status}", response=body)

    def _content_logprobs(
        self, turn: Turn, completion: CompletionOutput, counter: ReasoningTokens | None
    ) -> list[dict[str, Any]]:
        """The logprobs of the output's new tokens that are the answer's: `counter` (fed
        them here) tells the reasoning's, which its item has none of; none at all when the
        request leaves its reasoning out (vLLM's)."""
        num_top = turn.chat.top_logprobs or 0
        logprobs = self.chat.token_logprobs(completion, num_top)
        entries = logprobs["content"] if logprobs is not None else []
        if counter is None:
            return entries
        skipped = counter.feed(completion.token_ids)
        return entries[skipped:] if turn.request.include_reasoning else []

    def _remember(self, turn: Turn, body: dict[str, Any]) -> None:
        if turn.request.store:
            conversation = turn.conversation + conversation_items(body["output"])
            listed = []
            if turn.previous is not None:
                listed += [*turn.previous.listed_inputs, *turn.previous.body["output"]]
            listed += [listed_input(item) for item in turn.request.input_items]
            self.store.put(turn.id, body, conversation, listed)

    def _response(
        self,
        turn: Turn,
        status: str,
        output: list[dict[str, Any]],
        counts: dict[str, Any] | None,
    ) -> dict[str, Any]:
        request, chat = turn.request, turn.chat
        text_format = request.text_format.model_dump(by_alias=True, exclude_none=True)
        tool_choice = request.tool_choice or "auto"
        return {
            "id": turn.id,
            "object": "response",
            "created_at": turn.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": request.max_tool_calls,
            "metadata": request.metadata or {},
            "model": self.chat.models.reply_name(turn.chat.model),
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": {
                "effort": request.reasoning.effort if request.reasoning else None,
                "summary": request.reasoning.summary if request.reasoning else None,
            },
            "service_tier": "default",
            "store": request.store,
            "temperature": chat.temperature,
            "text": {"format": text_format, "verbosity": "medium"},
            "tool_choice": (
                tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump()
            ),
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "top_logprobs": request.top_logprobs or 0,
            "top_p": chat.top_p,
            "truncation": "disabled",
            "usage": counts,
            "user": request.user,
        }


def _chat_fields(request: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request a Responses request runs as."""
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "parallel_tool_calls": request.parallel_tool_calls,
        "include_reasoning": request.include_reasoning,
        **request.sampling_extras,
    }
    if request.reasoning is not None and request.reasoning.effort is not None:
        fields["reasoning_effort"] = request.reasoning.effort  # the template's, as vLLM's
    given = {
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "user": request.user,
    }
    fields.update({name: value for name, value in given.items() if value is not None})
    if request.wants_logprobs:
        fields.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    if request.tools:
        fields["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in request.tools
        ]
    choice = request.tool_choice
    if choice is not None and not isinstance(choice, str):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None and (request.tools or choice != "auto"):
        fields["tool_choice"] = choice  # "auto" without tools: nothing to choose from
    fmt = request.text_format
    if fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif fmt.type == "json_schema":
        json_schema = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
        fields["response_format"] = {"type": "json_schema", "json_schema": json_schema}
    return fields


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(
        404,
        f"No response with id {response_id!r}: it was never stored (store false), was "
        "deleted, or has expired or been dropped from this server's store "
        "(--response-store-ttl-s, --response-store-max-entries).",
        param=param,
    )
