"""OutputStreams: each running request's outputs, handed from the core's side (a thread)
to the asyncio side, and the engine's death certificate.

Both engine front ends (the in-process `AsyncEngine`, the `EngineCoreClient` of a core
process) are `EngineFrontEnd`s: `generate` registers a stream and queues the add command;
a thread that receives the core's replies calls `put_step` / `put` / `fail_all`. The
core's replies are token deltas: `put_step` turns them into outputs with the
`OutputProcessor` (text, stop strings) on that thread, and sends the stops it finds to
the core.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from serve.engine.messages import AbortRequest, AddRequest, Command, CoreStats
from serve.engine.output_processor import OutputProcessor
from serve.engine.protocol import EngineDeadError, RequestError, RequestTimeoutError
from serve.engine.request_metrics import RequestMetrics
from serve.lora_request import LoRARequest
from serve.multimodal_inputs import MultiModalInput
from serve.outputs import OutputKind, RequestOutput
from serve.sampling_params import SamplingParams
from serve.scheduler.output_deltas import RequestDelta


class _Stream:
    """One request's outputs, filled from the receiving thread, drained on its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        _call_soon(self.loop, self.queue.put_nowait, item)


class OutputStreams:
    def __init__(self, tokenizer: Any, send: Callable[[Command], None]) -> None:
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and dead_error between threads
        self.dead_error: EngineDeadError | None = None  # set once, by fail_all
        self._processor = OutputProcessor(tokenizer)
        self._send = send  # a command to the core

    @property
    def request_metrics(self) -> RequestMetrics:
        return self._processor.metrics

    async def generate(
        self,
        add: AddRequest,
        timeout_s: float | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, of `output_kind`, until it finishes. A reader that falls
        behind gets what queued up as one output at its next read (`_catch_up`). Closing or
        cancelling the iterator early, or `timeout_s` passing (RequestTimeoutError), sends
        an abort, which frees the request's blocks in the core."""
        request_id = add.request_id
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:  # a stream registered here is failed by any later fail_all
            if self.dead_error is not None:
                raise EngineDeadError(str(self.dead_error))  # a fresh one: its own traceback
            if request_id in self._streams:
                raise ValueError(f"A request with id {request_id!r} is already running.")
            self._streams[request_id] = stream
        self._processor.add_request(
            request_id, add.prompt, add.prompt_token_ids, add.params, output_kind
        )
        self._send(add)
        deadline = None if timeout_s is None else stream.loop.time() + timeout_s
        finished = False
        error: BaseException | None = None  # queued behind an output the reader had not read
        try:
            while not finished:
                if error is None:
                    item = await _next_before(stream.queue, deadline, timeout_s)
                else:
                    item = error
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                item, error = _catch_up(stream.queue, item, output_kind is OutputKind.DELTA)
                finished = item.finished
                yield item
        finally:
            self._processor.abort_request(request_id)  # forgotten, if not already
            if not finished:
                self._send(AbortRequest(request_id))
            with self._lock:
                self._streams.pop(request_id, None)

    def put_step(self, deltas: list[RequestDelta]) -> None:
        """Turn a step's token deltas into outputs, send the core the stops they call for,
        and hand the outputs over in one wake-up per event loop, not one per request."""
        step = self._processor.process(deltas)
        for command in step.to_core:
            self._send(command)
        by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput | BaseException]]
        ] = {}
        with self._lock:
            for output in step.outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                item: RequestOutput | BaseException = output
                if output.error is not None:
                    item = RequestError(output.error)
                by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def put(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)

    def fail_all(self, error: EngineDeadError) -> None:
        """The engine is gone: every running request and every later one fails with `error`."""
        with self._lock:
            self.dead_error = error
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(EngineDeadError(str(error)))


async def _next_before(
    items: asyncio.Queue, deadline: float | None, timeout_s: float | None
) -> RequestOutput | BaseException:
    if deadline is None:
        return await items.get()
    try:
        return await asyncio.wait_for(items.get(), deadline - asyncio.get_running_loop().time())
    except TimeoutError:
        raise RequestTimeoutError(
            f"The request did not finish within {timeout_s:g} s (the server's "
            "--request-timeout) and was stopped. A shorter input, or fewer tokens to "
            "generate (max_tokens), finishes sooner."
        ) from None


def _catch_up(
    items: asyncio.Queue, output: RequestOutput, deltas: bool
) -> tuple[RequestOutput, BaseException | None]:
    """`output` and the outputs queued behind it as one (cumulative ones: the newest;
    `deltas`: joined), and an error queued after them. A reader that fell behind (the
    event loop busier than the core) sends the tokens of several steps as one chunk, and
    catches up, instead of paying a chunk per token and falling further behind."""
    while not output.finished and not items.empty():
        item = items.get_nowait()
        if isinstance(item, BaseException):
            return output, item
        if deltas:
            output.add_delta(item)
        else:
            output = item
    return output, None


def _put_all(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable, *args) -> None:
    """Schedule on `loop` from another thread; a loop already closed has nobody to tell
    (its streams ended with it), and must not break the thread that delivers."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass


class EngineFrontEnd:
    """What both front ends share: requests go to the core as commands on a queue, and
    their outputs come back through OutputStreams."""

    def __init__(self, tokenizer: Any) -> None:
        self._commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._streams = OutputStreams(tokenizer, self._commands.put)
        self.core_stats: CoreStats | None = None  # the latest the core sent

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._streams.dead_error

    @property
    def request_metrics(self) -> RequestMetrics:
        return self._streams.request_metrics

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        timeout_s: float | None = None,
        priority: int = 0,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
        mm_inputs: tuple[MultiModalInput, ...] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, of `output_kind`, until it finishes or `timeout_s`
        passes. Closing or cancelling the iterator early aborts the request in the core
        and frees its blocks. `mm_inputs`: its prompt's images (`MultiModalProcessor`)."""
        add = AddRequest(
            request_id,
            list(prompt_token_ids),
            params,
            prompt,
            priority,
            lora_request,
            tuple(mm_inputs),
        )
        return self._streams.generate(add, timeout_s, output_kind)
