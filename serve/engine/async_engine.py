"""AsyncEngine: the EngineCore loop on a background thread of this process.

The in-process engine (`--disable-frontend-multiprocessing`, and the "before" of the
benchmarks); `EngineCoreClient` runs the same loop in its own process behind the same
interface (`EngineClient`). The boundary is the same plain messages either way: commands
in through a queue, each step's token deltas out to the requests' streams, whose output
processor decodes their text on a helper thread while the loop runs the next step (as a
core process's receiving thread does).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from pathlib import Path
from typing import Any

from serve.config import EngineConfig
from serve.engine.core import EngineCore
from serve.engine.core_loop import run_core_loop
from serve.engine.messages import Command, CoreStats, Stop
from serve.engine.output_streams import EngineFrontEnd, OutputStreams
from serve.engine.protocol import EngineDeadError, RequestError, request_error_message
from serve.lora_request import LoRARequest
from serve.sampling_params import SamplingParams, StructuredOutputsParams
from serve.scheduler.output_deltas import RequestDelta

__all__ = ["AsyncEngine", "EngineDeadError"]

logger = logging.getLogger(__name__)


class _QueueCommands:
    def __init__(self, commands: queue.SimpleQueue[Command | None]) -> None:
        self.commands = commands

    def get(self, block: bool, timeout: float | None = None) -> Command | None:
        try:
            return self.commands.get(block=block, timeout=timeout)
        except queue.Empty:
            return None


class _StreamReplies:
    def __init__(self, front_end: EngineFrontEnd, streams: OutputStreams) -> None:
        self.front_end = front_end
        self.streams = streams
        # One thread, so steps are processed in order, beside the loop's next step.
        self._output_thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine-outputs"
        )

    def put_step(self, deltas: list[RequestDelta]) -> None:
        self._output_thread.submit(self.streams.put_step, deltas).add_done_callback(_log_failure)

    def request_failed(self, request_id: str, error: Exception) -> None:
        if not isinstance(error, ValueError):
            error = RequestError(request_error_message(error))
        self.streams.put(request_id, error)

    def put_stats(self, stats: CoreStats) -> None:
        self.front_end.core_stats = stats


def _log_failure(future: concurrent.futures.Future) -> None:
    if future.exception() is not None:
        logger.error("Processing a step's outputs failed", exc_info=future.exception())


class AsyncEngine(EngineFrontEnd):
    def __init__(self, core: EngineCore) -> None:
        super().__init__(core.tokenizer)
        self.core = core
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(EngineCore(config))

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def model_path(self) -> Path:
        return self.core.model_path

    def check_token_ids(self, token_ids: list[int], what: str = "Token ids") -> None:
        self.core.check_token_ids(token_ids, what)

    def check_params(self, params: SamplingParams) -> None:
        self.core.check_params(params)

    async def check_lora(self, lora: LoRARequest) -> None:
        await asyncio.to_thread(self.core.adapters.check, lora)

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a request's grammar (or find it compiled) off the event loop, so that an
        invalid one is refused (ValueError) before the request starts. The engine then
        finds it in its cache."""
        await asyncio.wrap_future(self.core.structured_output.submit(spec))

    def shutdown(self) -> None:
        self._commands.put(Stop())
        self._thread.join(timeout=10)
        if self._streams.dead_error is None:
            self._streams.fail_all(EngineDeadError("The engine was shut down."))

    def _run(self) -> None:
        try:
            run_core_loop(
                self.core, _QueueCommands(self._commands), _StreamReplies(self, self._streams)
            )
        except BaseException as e:  # a fault here ends the engine: fail everyone, loudly
            logger.exception("Engine loop died")
            self._streams.fail_all(EngineDeadError(f"The engine failed: {e!r}"))
        finally:
            self.core.shutdown()  # its workers go with it
