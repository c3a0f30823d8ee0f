"""AsyncEngine: the EngineCore loop on a background thread, one output stream per request.

The boundary is two queues of plain messages — commands in (add / abort), RequestOutputs
out — so the loop can later move to its own process without changing the asyncio side.
The loop blocks on the command queue when idle and wakes the moment a request arrives.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from serve.config import EngineConfig
from serve.engine.core import EngineCore
from serve.outputs import RequestOutput
from serve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served until a restart."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None


@dataclass(frozen=True)
class _Abort:
    request_id: str


_STOP = object()


class _Stream:
    """One request's outputs, filled from the engine thread, drained on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams between the loop and the thread
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(EngineCore(config))

    # -- asyncio side --------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a request's grammar (or find it compiled) off the event loop, so that an
        invalid one is refused (ValueError) before the request starts. The engine then
        finds it in its cache."""
        await asyncio.wrap_future(self.core.structured_output.submit(spec))

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request until it finishes. Closing or cancelling the
        iterator early aborts the request in the engine and frees its blocks."""
        if not self.is_alive:
            raise EngineDeadError(f"The engine is not running: {self.dead_error!r}")
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"A request with id {request_id!r} is already running.")
            self._streams[request_id] = stream
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, prompt))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))
            with self._lock:
                self._streams.pop(request_id, None)

    def shutdown(self) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout=10)

    # -- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        core = self.core
        stats = _Stats(core)
        try:
            while True:
                # Idle: block until a command arrives. Busy: take whatever is queued.
                block = not core.has_unfinished_requests()
                while True:
                    try:
                        command = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    if block:
                        stats.start_window(core)  # idle time is not throughput
                    if command is _STOP:
                        return
                    self._apply(command)
                    block = False
                if not core.has_unfinished_requests():
                    continue
                outputs = core.step()
                stats.record(core)
                self._deliver_step(outputs)
        except BaseException as e:  # a fault here ends the engine: fail everyone, loudly
            logger.exception("Engine loop died")
            self.dead_error = e
            with self._lock:
                streams = list(self._streams.values())
            for stream in streams:
                stream.put(EngineDeadError(f"The engine failed: {e!r}"))

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.core.abort_request(command.request_id)
            return
        try:
            self.core.add_request(
                command.request_id, command.prompt_token_ids, command.params, command.prompt
            )
        except ValueError as e:
            self._deliver(command.request_id, e)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs over in one wake-up per event loop, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


class _Stats:
    """The periodic stats line while the engine is busy."""

    def __init__(self, core: EngineCore) -> None:
        self.start_window(core)

    def start_window(self, core: EngineCore) -> None:
        self.last_log = time.monotonic()
        self.tokens_at_start = core.num_generated_tokens
        self.times_at_start = replace(core.step_times)

    def record(self, core: EngineCore) -> None:
        now = time.monotonic()
        if now - self.last_log < STATS_INTERVAL_S:
            return
        stats = core.stats()
        elapsed = now - self.last_log
        times = core.step_times.since(self.times_at_start)
        per_step_ms = 1000 / max(times.num_steps, 1)
        logger.info(
            "running %d, waiting %d, swapped %d requests; KV cache %.1f%% used, prefix cache "
            "hit rate %.1f%%; %d preemptions; generation %.1f tokens/s; forward busy %.0f%%; "
            "per step (ms): schedule %.1f, prepare %.1f, forward %.1f, sample %.1f, output %.1f",
            stats.num_running,
            stats.num_waiting,
            stats.num_swapped,
            100 * stats.num_blocks_used / stats.num_blocks_total,
            100 * stats.prefix_cache_hit_rate,
            stats.num_preemptions,
            (core.num_generated_tokens - self.tokens_at_start) / elapsed,
            100 * times.forward_s / elapsed,
            times.schedule_s * per_step_ms,
            times.prepare_s * per_step_ms,
            times.forward_s * per_step_ms,
            times.sample_s * per_step_ms,
            times.output_s * per_step_ms,
        )
        self.start_window(core)
