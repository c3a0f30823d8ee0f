"""OutputStreams: each running request's outputs, handed from the core's side (a thread)
to the asyncio side, and the engine's death certificate.

Both engine front ends (the in-process `AsyncEngine`, the `EngineCoreClient` of a core
process) are `EngineFrontEnd`s: `generate` registers a stream and queues the add command;
a thread that receives the core's replies calls `put_step` / `put` / `fail_all`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable

from serve.engine.messages import AbortRequest, AddRequest, Command, CoreStats
from serve.engine.output_deltas import OutputDelta, apply_delta
from serve.engine.protocol import EngineDeadError, RequestError, RequestTimeoutError
from serve.outputs import RequestOutput
from serve.sampling_params import SamplingParams


class _Stream:
    """One request's outputs, filled from the receiving thread, drained on its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, add: AddRequest) -> None:
        self.loop = loop
        self.add = add
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.last: RequestOutput | None = None  # the newest output, for deltas to apply to

    def put(self, item: RequestOutput | BaseException) -> None:
        _call_soon(self.loop, self.queue.put_nowait, item)


class OutputStreams:
    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and dead_error between threads
        self.dead_error: EngineDeadError | None = None  # set once, by fail_all

    async def generate(
        self, add: AddRequest, send: Callable[[Command], None], timeout_s: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request until it finishes. Closing or cancelling the
        iterator early, or `timeout_s` passing (RequestTimeoutError), sends an abort,
        which frees the request's blocks in the core."""
        request_id = add.request_id
        stream = _Stream(asyncio.get_running_loop(), add)
        with self._lock:  # a stream registered here is failed by any later fail_all
            if self.dead_error is not None:
                raise EngineDeadError(str(self.dead_error))  # a fresh one: its own traceback
            if request_id in self._streams:
                raise ValueError(f"A request with id {request_id!r} is already running.")
            self._streams[request_id] = stream
        send(add)
        deadline = None if timeout_s is None else stream.loop.time() + timeout_s
        finished = False
        try:
            while not finished:
                item = await _next_before(stream.queue, deadline, timeout_s)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                send(AbortRequest(request_id))
            with self._lock:
                self._streams.pop(request_id, None)

    def put_step(self, outputs: list[RequestOutput] | list[OutputDelta]) -> None:
        """Hand a step's outputs over in one wake-up per event loop, not one per request.
        A core process sends deltas (output_deltas.py): each is applied to its stream's
        last output, with the prompt the stream holds."""
        by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput | BaseException]]
        ] = {}
        with self._lock:
            for item in outputs:
                stream = self._streams.get(item.request_id)
                if stream is None:
                    continue
                out: RequestOutput | BaseException = item
                if item.error is not None:
                    out = RequestError(item.error)
                elif isinstance(item, OutputDelta):
                    add = stream.add
                    out = apply_delta(stream.last, item, add.prompt, add.prompt_token_ids)
                if isinstance(out, RequestOutput):
                    stream.last = out
                by_loop.setdefault(stream.loop, []).append((stream, out))
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
            "--request-timeout) and was stopped. Ask for fewer tokens (max_tokens)."
        ) from None


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

    def __init__(self) -> None:
        self._commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._streams = OutputStreams()
        self.core_stats: CoreStats | None = None  # the latest the core sent

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._streams.dead_error

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request until it finishes or `timeout_s` passes.
        Closing or cancelling the iterator early aborts the request in the core and
        frees its blocks."""
        add = AddRequest(request_id, list(prompt_token_ids), params, prompt)
        return self._streams.generate(add, self._commands.put, timeout_s)
