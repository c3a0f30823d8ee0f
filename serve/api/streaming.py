"""Turning engine streams into a response: the `n` choices of each prompt numbered as
OpenAI numbers them, the content, finish and usage chunks of a streamed response (from
DELTA outputs: the engine holds back text that may still become a stop string), a failure
mid-stream as an error event, and the final outputs of a non-streamed one (an engine error
as its HTTP status)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from serve.api.errors import APIError, error_body
from serve.api.sse import SSE_DONE, ChunkWriter, sse
from serve.chat.reasoning_parsers import ReasoningTokens
from serve.engine.protocol import (
    EngineDeadError,
    RequestError,
    RequestTimeoutError,
)
from serve.outputs import CompletionOutput, RequestOutput


async def merge_streams(
    streams: list[AsyncGenerator[RequestOutput, None]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come, tagged with their index.
    Closing the merged iterator closes (and so aborts) every request still running."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()  # abort now, not when the generator is collected
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as e:
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class ChoiceProgress:
    """What one streamed choice has sent so far."""

    num_tokens: int = 0
    finish_reason: str | None = None


@dataclass
class StreamState:
    num_choices: int
    choices: list[ChoiceProgress] = field(default_factory=list)

    # With --reasoning-parser: each choice's count of its reasoning tokens, fed every
    # delta's tokens; the usage then has completion_tokens_details. None: not counted.
    reasoning_tokens: list[ReasoningTokens] | None = None

    def __post_init__(self) -> None:
        self.choices = [ChoiceProgress() for _ in range(self.num_choices)]

    # By engine request: its prompt tokens the prefix cache held (each output carries it),
    # and its first output with the prompt's logprobs (a DELTA stream gives them once).
    cached_tokens: dict[int, int] = field(default_factory=dict)
    prompt_outputs: dict[int, RequestOutput] = field(default_factory=dict)

    def note(self, stream_index: int, out: RequestOutput) -> None:
        """What engine request `stream_index`'s output says beside its choices."""
        if out.num_cached_tokens is not None:
            self.cached_tokens[stream_index] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_outputs.setdefault(stream_index, out)

    @property
    def num_cached_tokens(self) -> int:
        return sum(self.cached_tokens.values())

    def take(self, index: int, delta: CompletionOutput) -> None:
        """Count choice `index`'s next DELTA output."""
        progress = self.choices[index]
        progress.num_tokens += len(delta.token_ids)
        progress.finish_reason = delta.finish_reason
        if self.reasoning_tokens is not None:
            self.reasoning_tokens[index].feed(delta.token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    @property
    def num_reasoning_tokens(self) -> int | None:
        counts = self.reasoning_tokens
        return None if counts is None else sum(count.num_tokens for count in counts)


UsageCallback = Callable[[dict[str, Any]], None]


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
    reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """OpenAI's usage; with `cached_tokens` (vLLM's --enable-prompt-tokens-details), its
    `prompt_tokens_details`: the prompt tokens the prefix cache held; with
    `reasoning_tokens` (a --reasoning-parser's, as vLLM counts them), its
    `completion_tokens_details`: the completion tokens that were reasoning."""
    counts: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counts


# What an engine request's stream may raise, and the HTTP status each means. ValueError
# last: the engine refused the request (its message names the field).
_ENGINE_ERROR_STATUS: tuple[tuple[type[Exception], int], ...] = (
    (EngineDeadError, 503),
    (RequestError, 500),  # the engine failed this request alone
    (RequestTimeoutError, 504),  # --request-timeout
    (ValueError, 400),
)


_ENGINE_ERRORS = tuple(kind for kind, _ in _ENGINE_ERROR_STATUS)


def _engine_error_status(error: Exception) -> int:
    return next(status for kind, status in _ENGINE_ERROR_STATUS if isinstance(error, kind))


@dataclass
class StreamFailure:
    error: dict[str, Any] | None = None


@asynccontextmanager
async def guard_stream(path: str = "") -> AsyncIterator[StreamFailure]:
    """Turn a failure mid-stream (the response has started: its status is sent) into an
    error event for the client, in the error shape of `path`'s API, instead of a
    connection cut without a word."""
    failure = StreamFailure()
    try:
        yield failure
    except _ENGINE_ERRORS as e:
        failure.error = error_body(_engine_error_status(e), str(e), path=path)


# (index, DELTA output) -> the choice's fields in each content chunk to send (none, one or
# several).
ContentFields = Callable[[int, CompletionOutput], list[dict[str, Any]]]


# (index, finished completion) -> the choice's fields in each last chunk: anything held
# back, then the finish chunk (`finish_chunk`).
FinishFields = Callable[[int, CompletionOutput], list[dict[str, Any]]]


def finish_chunk(
    completion: CompletionOutput, finish_reason: str | None = None, **fields: Any
) -> dict[str, Any]:
    """A choice's finish-chunk fields; `finish_reason` overrides the engine's."""
    return {
        **fields,
        "logprobs": None,
        "finish_reason": finish_reason or completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


async def choice_outputs(
    streams: list[AsyncGenerator[RequestOutput, None]], n: int, state: StreamState | None = None
) -> AsyncIterator[tuple[int, CompletionOutput]]:
    """Every choice's outputs as they come: choice `i * n + j` is output j of prompt i, as
    OpenAI numbers them. `state` notes what each request's outputs say beside them."""
    async for stream_index, out in merge_streams(streams):
        if state is not None:
            state.note(stream_index, out)
        for completion in out.outputs:
            yield stream_index * n + completion.index, completion


async def final_outputs(
    streams: list[AsyncGenerator[RequestOutput, None]],
) -> list[RequestOutput]:
    """Each request's last (complete) output, in the order of `streams`."""
    last: dict[int, RequestOutput] = {}
    try:
        async for stream_index, out in merge_streams(streams):
            last[stream_index] = out
    except _ENGINE_ERRORS as e:
        raise APIError(_engine_error_status(e), str(e)) from None
    return [last[i] for i in range(len(streams))]


async def stream_choices(
    streams: list[AsyncGenerator[RequestOutput, None]],
    n: int,
    writer: ChunkWriter,
    num_prompt_tokens: int,
    content_fields: ContentFields,
    finish_fields: FinishFields,
    on_usage: UsageCallback | None,
    shows_cached_tokens: bool = False,
    state: StreamState | None = None,
) -> AsyncIterator[bytes]:
    """The content, finish and usage chunks of a streamed response (from DELTA outputs),
    then [DONE]. Chat and completions differ only in the fields of a choice, which the
    callers supply. `shows_cached_tokens`: the usage has `prompt_tokens_details`. A
    caller whose fields read the outputs' other news passes the `state` it reads."""
    if state is None:
        state = StreamState(len(streams) * n)
    async with guard_stream() as failed:
        async for index, completion in choice_outputs(streams, n, state):
            if state.choices[index].finish_reason is not None:
                continue  # said all it had
            state.take(index, completion)
            writer.add_token_ids(index, completion.token_ids)
            num_tokens = state.choices[index].num_tokens
            if completion.text or (completion.logprobs is not None and completion.token_ids):
                for fields in content_fields(index, completion):
                    yield writer.chunk(index, num_tokens, **fields, finish_reason=None)
            if completion.finished():
                for fields in finish_fields(index, completion):
                    yield writer.chunk(index, num_tokens, **fields)
    cached = state.num_cached_tokens if shows_cached_tokens else None
    counts = usage(num_prompt_tokens, state.completion_tokens, cached, state.num_reasoning_tokens)
    for event in stream_end(writer, failed, counts, on_usage):
        yield event


def stream_end(
    writer: ChunkWriter,
    failure: StreamFailure,
    counts: dict[str, Any],
    on_usage: UsageCallback | None,
) -> Iterator[bytes]:
    """A streamed response's last events: the error of a failure mid-stream, else the
    usage chunk when the client asked for one; then [DONE]. `on_usage` hears the counts."""
    if on_usage is not None:
        on_usage(counts)
    if failure.error is not None:
        yield sse(failure.error)
    elif writer.include_usage:
        yield writer.usage_chunk(counts)
    yield SSE_DONE
