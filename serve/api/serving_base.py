"""What chat and completions share: the request limits and the context-window check,
numbering the `n` choices of each prompt, holding back text that may yet turn out to be a
stop string, and usage."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from serve.api.errors import APIError, error_body
from serve.api.limits import RequestLimits
from serve.api.protocol import SamplingRequest, now
from serve.config import ResponseStoreConfig
from serve.engine.protocol import (
    EngineClient,
    EngineDeadError,
    RequestError,
    RequestTimeoutError,
)
from serve.engine.validation import check_priority
from serve.outputs import CompletionOutput, RequestOutput
from serve.sampling_params import StructuredOutputsParams

T = TypeVar("T")


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    model_path: str
    api_keys: tuple[str, ...] = ()  # empty: no key needed
    chat_template: str | None = None
    # A request's own `chat_template` is rendered only when the operator trusts clients
    # with it (sandboxed or not, a template is code the server runs for them).
    trust_request_chat_template: bool = False
    metrics_public: bool = False  # /metrics needs no key
    metrics_names: str = "serve"  # the prefix of the vLLM-shaped series: serve_ or vllm:
    allowed_origins: tuple[str, ...] = ()  # CORS for these browser origins; empty: no CORS
    tool_call_parser: str | None = None  # tool_choice "auto" reads calls in this format
    max_generating_requests: int | None = None  # in flight, running or queued; None: no cap
    max_body_bytes: int | None = None
    request_timeout_s: float | None = None  # a generation request's deadline; None: none
    grammar_compile_timeout_s: float | None = None  # compiling a request's grammar
    scheduling_policy: str = "fcfs"  # a request's `priority` is refused under the others
    limits: RequestLimits = field(default_factory=RequestLimits)
    response_store: ResponseStoreConfig = field(default_factory=ResponseStoreConfig)


def check_limits(request: SamplingRequest, settings: ServerSettings) -> None:
    """A 400 naming the flag for a request that asks for more than this server allows,
    or for a `priority` it does not schedule by. Cheap: checked before the prompt is
    tokenized."""
    try:
        check_priority(request.priority, settings.scheduling_policy)
    except ValueError as e:
        raise APIError(400, str(e), param="priority") from None
    limits = settings.limits
    for name, value in (("n", request.n), ("best_of", request.best_of)):
        if value is not None and value > limits.max_n:
            raise APIError(
                400,
                f"{name} is {value}; this server allows at most {limits.max_n} (--max-n).",
                param=name,
            )
    stop_lists = {
        "stop": request.stop if isinstance(request.stop, list) else None,
        "stop_token_ids": request.stop_token_ids,
        "bad_words": request.bad_words,
    }
    for name, entries in stop_lists.items():
        _check_num_entries(name, entries, limits.max_stop_sequences, "--max-stop-sequences")
    _check_num_entries("logit_bias", request.logit_bias, limits.max_logit_bias, "--max-logit-bias")


def _check_num_entries(
    name: str, entries: list[Any] | dict[str, Any] | None, limit: int, flag: str
) -> None:
    if entries is not None and len(entries) > limit:
        raise APIError(
            400,
            f"{name} has {len(entries)} entries; this server allows at most {limit} ({flag}).",
            param=name,
        )


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int) -> int:
    """The completion budget; a 400 in OpenAI's words when prompt + output cannot fit
    (with `requested` None, at least one token of output must)."""
    if prompt_len + (1 if requested is None else requested) > max_model_len:
        asked = prompt_len + (requested or 0)
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {asked} tokens ({prompt_len} in the prompt, {requested or 0} for the "
            "completion). Please reduce the length of the prompt or the completion.",
            param="messages" if requested is None else "max_tokens",
            code="context_length_exceeded",
        )
    return requested if requested is not None else max_model_len - prompt_len


# Rendering and tokenizing prompts run here, off the event loop (a long prompt takes
# seconds, and would stall every stream), on one thread: HF fast tokenizers are not safe
# to call from several threads at once.
_PROMPT_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="api-prompt")


async def off_the_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the prompt thread."""
    return await asyncio.get_running_loop().run_in_executor(_PROMPT_THREAD, fn, *args)


class PromptCharLimit:
    """A prompt text too long for the context window, found before it is tokenized.

    Tokenizing costs time in proportion to the text (seconds for megabytes), so a prompt
    that cannot fit is refused on its length in characters first: no token of this
    tokenizer spells more than `max_token_chars` characters, so a text of n characters is
    at least n / max_token_chars tokens. The bound is loosened 4x, for normalizers that
    fold several characters into one (combining accents, collapsed whitespace)."""

    SLACK = 4

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        max_token_chars = max((len(token) for token in tokenizer.get_vocab()), default=1)
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * max(max_token_chars, 1) * self.SLACK

    def check(self, text: str, param: str) -> None:
        if len(text) > self.max_chars:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, the prompt has {len(text)} characters, far more than that many "
                "tokens can hold. Please reduce the length of the prompt.",
                param=param,
                code="context_length_exceeded",
            )


def check_model(model: str | None, settings: ServerSettings) -> None:
    if model not in (None, settings.served_model_name, settings.model_path):
        raise APIError(
            404,
            f"The model `{model}` does not exist. This server serves "
            f"`{settings.served_model_name}`.",
            param="model",
            code="model_not_found",
        )


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

    num_chars: int = 0
    num_tokens: int = 0
    finish_reason: str | None = None


@dataclass
class StreamState:
    num_choices: int
    holdback: int  # chars that could still be the start of a stop string
    choices: list[ChoiceProgress] = field(default_factory=list)
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        self.choices = [ChoiceProgress() for _ in range(self.num_choices)]

    def delta(self, index: int, completion: CompletionOutput) -> tuple[str, int, int]:
        """New text, and the range of new tokens, for choice `index`."""
        progress = self.choices[index]
        end = len(completion.text)
        if not completion.finished:
            end = max(progress.num_chars, end - self.holdback)
        text = completion.text[progress.num_chars : end]
        first_token = progress.num_tokens
        progress.num_chars = end
        progress.num_tokens = len(completion.token_ids)
        progress.finish_reason = completion.finish_reason
        return text, first_token, progress.num_tokens

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)


def stop_holdback(stop: str | list[str] | None) -> int:
    stops = [stop] if isinstance(stop, str) else (stop or [])
    return max((len(s) for s in stops), default=1) - 1


UsageCallback = Callable[[dict[str, int]], None]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# Python's str.splitlines, and so httpx's `aiter_lines`, also ends a line at U+0085, U+2028
# and U+2029, which json.dumps leaves raw inside strings; escaped, a token's text cannot cut
# an event in two for such a client. (Lower control characters json.dumps escapes itself.)
_LINE_BREAKS_KEPT_RAW = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(payload: dict[str, Any]) -> str:
    """`payload` as one SSE data line: no character in it ends a line for any client."""
    return json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS_KEPT_RAW)


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {sse_json(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ChunkWriter:
    """Frames one streamed response's chunks: the same id, created time and model on each."""

    id: str
    object: str
    model: str
    include_usage: bool
    created: int = field(default_factory=now)

    def chunk(self, index: int, **choice: Any) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, **choice}],
        }
        if self.include_usage:
            body["usage"] = None  # OpenAI sends the key on every chunk, null until the last
        return sse(body)

    def usage_chunk(self, counts: dict[str, int]) -> str:
        body = {"id": self.id, "object": self.object, "created": self.created}
        return sse({**body, "model": self.model, "choices": [], "usage": counts})


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


# (index, completion, new text, first new token, end of new tokens, chars sent before)
# -> the choice's fields in each content chunk to send (none, one or several).
ContentFields = Callable[[int, CompletionOutput, str, int, int, int], list[dict[str, Any]]]
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
    streams: list[AsyncGenerator[RequestOutput, None]], n: int
) -> AsyncIterator[tuple[int, CompletionOutput]]:
    """Every choice's output as it grows: choice `i * n + j` is output j of prompt i, as
    OpenAI numbers them."""
    async for stream_index, out in merge_streams(streams):
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
    stop: str | list[str] | None,
    num_prompt_tokens: int,
    content_fields: ContentFields,
    finish_fields: FinishFields,
    on_usage: UsageCallback | None,
) -> AsyncIterator[str]:
    """The content, finish and usage chunks of a streamed response, then [DONE]. Chat and
    completions differ only in the fields of a choice, which the callers supply."""
    state = StreamState(len(streams) * n, stop_holdback(stop))
    async with guard_stream() as failed:
        async for index, completion in choice_outputs(streams, n):
            if state.choices[index].finish_reason is not None:
                continue  # a sibling moved on; this choice has said all it had
            sent_chars = state.choices[index].num_chars
            text, start, end = state.delta(index, completion)
            if text or (completion.logprobs is not None and end > start):
                for fields in content_fields(index, completion, text, start, end, sent_chars):
                    yield writer.chunk(index, **fields, finish_reason=None)
            if completion.finished:
                for fields in finish_fields(index, completion):
                    yield writer.chunk(index, **fields)
    counts = usage(num_prompt_tokens, state.completion_tokens)
    if on_usage is not None:
        on_usage(counts)
    if failed.error is not None:
        yield sse(failed.error)
    elif writer.include_usage:
        yield writer.usage_chunk(counts)
    yield SSE_DONE


def ranked_alternatives(top: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    """The `num_top` most likely (token id, logprob) pairs of one position, best first."""
    return sorted(top.items(), key=lambda kv: kv[1], reverse=True)[:num_top]


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def prompt_logprobs_json(
    tokenizer: Any, out: RequestOutput, num_top: int
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token, null for the first, else
    {token id: {logprob, decoded_token}} for the prompt token and the `num_top` best."""
    if out.prompt_logprobs is None:
        return None
    result: list[dict[str, dict[str, Any]] | None] = []
    for token_id, top in zip(out.prompt_token_ids, out.prompt_logprobs):
        if top is None:
            result.append(None)
            continue
        entries = dict(ranked_alternatives(top, num_top))
        entries[token_id] = top[token_id]
        result.append(
            {
                str(t): {"logprob": lp, "decoded_token": token_text(tokenizer, t)}
                for t, lp in entries.items()
            }
        )
    return result


def open_stream(
    engine: EngineClient,
    request: SamplingRequest,
    request_id: str,
    prompt_token_ids: list[int],
    prompt: str | None,
    max_tokens: int,
    num_logprobs: int | None,
    timeout_s: float | None = None,
) -> AsyncGenerator[RequestOutput, None]:
    """One engine request for a prompt's `n` choices, which share the prompt's KV blocks;
    it is stopped with RequestTimeoutError after `timeout_s`."""
    try:
        params = request.sampling_params(max_tokens, num_logprobs)
        engine.check_params(params)
    except ValueError as e:
        raise APIError(400, str(e), param=_param_named(str(e), request)) from None
    return engine.generate(
        request_id, prompt_token_ids, params, prompt, timeout_s, priority=request.priority
    )


def _param_named(message: str, request: SamplingRequest) -> str | None:
    """The request field an engine-side message starts with (they all do), if it is one."""
    first = message.split(" ", 1)[0]
    fields = type(request).model_fields
    if first == "logprobs" and "top_logprobs" in fields:
        return "top_logprobs"  # chat's count of alternatives; its `logprobs` is a switch
    return first if first in fields else None


async def check_structured_output(
    engine: EngineClient, request: SamplingRequest, timeout_s: float | None = None
) -> None:
    """Compile the request's grammar before it starts: an invalid schema, regex or grammar,
    or one that takes longer than `timeout_s` to compile, is a 400 naming the problem and
    never reaches the engine loop."""
    try:
        spec = request.structured_outputs_params()
        if spec is not None:
            await _compile_within(engine, spec, timeout_s)
    except ValueError as e:
        param = next(
            (f for f in STRUCTURED_OUTPUT_FIELDS if getattr(request, f, None) is not None), None
        )
        raise APIError(400, str(e), param=param) from None


async def _compile_within(
    engine: EngineClient, spec: StructuredOutputsParams, timeout_s: float | None
) -> None:
    try:
        await asyncio.wait_for(engine.compile_grammar(spec), timeout_s)
    except TimeoutError:
        # The compile thread runs on (it cannot be interrupted); the request is refused.
        raise ValueError(
            f"Compiling this request's structured output took longer than {timeout_s:g} s "
            "(the server's --grammar-compile-timeout). Simplify the schema, regex or grammar."
        ) from None


STRUCTURED_OUTPUT_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tool_choice",
)
