"""EngineCoreClient: the API process's engine, with the engine core in its own process.

The API process keeps the tokenizer and what validation needs (vocab size, max_model_len,
max logprobs, a grammar compiler), and decodes the text; the core process
(core_process.py) keeps the model, the KV cache, the scheduler and the sampler. Two
daemon threads carry the messages so that the event loop never blocks on a pipe:

    generate() ─▶ commands queue ─▶ [sender thread] ─▶ pipe ─▶ core process
    streams   ◀── [receiver thread] ◀── pipe ◀── one list[RequestDelta] per step
                   └ text, stop strings (OutputProcessor); stops ─▶ commands queue

The receiver waits on the pipe and the process's sentinel together, so a core that dies
(killed, crashed) is noticed at once: every running request fails with EngineDeadError,
`is_alive` turns False, and the cause is logged once. `shutdown()` sends Stop, waits, then
terminates; a core whose parent dies exits by itself (its pipes close).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from serve.config import EngineConfig
from serve.engine.core_process import STARTUP_ERROR_TYPES, run_core_process, send_quietly
from serve.engine.lora_check import AdapterChecker
from serve.engine.messages import (
    AddRequest,
    CoreFailed,
    CoreReady,
    CoreStats,
    RequestFailed,
    Stop,
    decode_reply,
)
from serve.engine.output_streams import EngineFrontEnd
from serve.engine.protocol import EngineDeadError, EngineStartError, RequestError
from serve.engine.validation import check_params, check_token_ids
from serve.lora_request import LoRARequest
from serve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0  # for the core to finish its step and exit after Stop
EXIT_WAIT_S = 5.0  # for a core that said it failed, or whose pipe closed, to exit

# Start-up errors the parent re-raises as they were raised in the core (the CLI shows
# these as `serve: error: ...`); any other kind becomes a RuntimeError.
_STARTUP_ERRORS = {kind.__name__: kind for kind in STARTUP_ERROR_TYPES}


class EngineCoreClient(EngineFrontEnd):
    def __init__(
        self, config: EngineConfig, while_core_loads: Callable[[], None] | None = None
    ) -> None:
        """Start the core and wait until it is ready. This module imports nothing heavy
        before the core's process starts; its own (and `while_core_loads`: the caller's
        imports, say) load while the core loads the model."""
        self._threads: list[threading.Thread] = []  # the receiver and the sender, once ready
        self._core_error: str | None = None  # the cause a dying core sent, if it could
        self._is_stopping = False
        context = multiprocessing.get_context("spawn")  # never fork a process with torch
        command_reader, self._command_writer = context.Pipe(duplex=False)
        self._output_reader, output_writer = context.Pipe(duplex=False)
        self._process = context.Process(
            target=run_core_process,
            args=(config, command_reader, output_writer, *_logging_setup()),
            name="serve-engine-core",
        )
        self._process.start()
        # Only the child holds these ends now, so its exit reads as EOF here, and ours as
        # EOF there.
        command_reader.close()
        output_writer.close()
        atexit.register(self.shutdown)  # before multiprocessing's exit hook joins the child
        try:
            _import_front_end_code()
            if while_core_loads is not None:
                while_core_loads()
            ready = self._wait_ready()
            from serve.models.tokenizer import load_tokenizer

            self.tokenizer: Any = load_tokenizer(config.model.tokenizer or ready.model_path)
        except BaseException:
            self.shutdown()
            raise
        super().__init__(self.tokenizer)  # the streams decode text with it
        self.model_path: Path = ready.model_path
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.max_logprobs = ready.max_logprobs
        self.eos_token_ids = ready.eos_token_ids
        self.pooling = ready.pooling
        from serve.models.loader import load_hf_config
        from serve.worker.lazy_structured_output import LazyStructuredOutput

        self._grammars = LazyStructuredOutput(
            lambda: self.tokenizer, self.vocab_size, self.eos_token_ids
        )
        self._adapters = AdapterChecker(config, lambda: load_hf_config(self.model_path))
        self._threads = [
            threading.Thread(target=self._receive_replies, name="engine-core-receive", daemon=True),
            threading.Thread(target=self._send_commands, name="engine-core-send", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- the engine interface ------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None

    def check_token_ids(self, token_ids: list[int], what: str = "Token ids") -> None:
        check_token_ids(token_ids, self.vocab_size, what)

    def check_params(self, params: SamplingParams) -> None:
        params.update_from_tokenizer(self.tokenizer, self.vocab_size)  # bad words, for the check
        check_params(params, self.vocab_size, self.max_logprobs, self.pooling, self.eos_token_ids)

    async def check_lora(self, lora: LoRARequest) -> None:
        """Read the adapter here, off the event loop, as the core and workers will."""
        await asyncio.to_thread(self._adapters.check, lora)

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a request's grammar here, off the event loop, so that an invalid one is
        refused (ValueError) before the request starts. The core compiles it again, from
        its own cache."""
        manager = self._grammars.built or await asyncio.to_thread(self._grammars.get)
        await asyncio.wrap_future(manager.submit(spec))

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the core: Stop, then SIGKILL (it ignores SIGTERM, which a service manager
        sends the whole process group). Running requests fail with EngineDeadError.
        Idempotent."""
        if self._is_stopping:
            return
        self._is_stopping = True
        atexit.unregister(self.shutdown)
        if self._threads:  # Stop queues behind the commands sent before it
            self._commands.put(Stop())
        else:
            send_quietly(self._command_writer, Stop())
        self._process.join(timeout_s)
        if self._process.exitcode is None:
            logger.warning("The engine core did not stop in %.0f s; killing it.", timeout_s)
            self._process.kill()
            self._process.join()
        if self._threads:
            receiver, sender = self._threads
            receiver.join()  # ends at the pipe's EOF: the core has exited
            self._commands.put(None)
            sender.join()
        self._command_writer.close()
        self._output_reader.close()

    # -- start-up ------------------------------------------------------------------------

    def _wait_ready(self) -> CoreReady:
        """The core's ready message, or its start-up error raised here."""
        message = self._next_message()
        if isinstance(message, CoreReady):
            return message
        self._process.join(EXIT_WAIT_S)
        if isinstance(message, CoreFailed):
            kind = _STARTUP_ERRORS.get(message.error_type)
            if kind is not None:
                raise kind(message.message)
            raise EngineStartError(
                f"The engine core failed to start: {message.error_type}: {message.message}"
            )
        raise EngineStartError(
            f"The engine core process exited while starting ({_exit_cause(self._process)})."
        )

    # -- the threads ---------------------------------------------------------------------

    def _next_message(self) -> object | None:
        """The core's next message; None once it has exited and said everything."""
        if self._output_reader not in wait([self._output_reader, self._process.sentinel]):
            return None
        try:
            return decode_reply(self._output_reader.recv_bytes())
        except (EOFError, OSError):
            return None

    def _receive_replies(self) -> None:
        while (message := self._next_message()) is not None:
            if isinstance(message, list):
                self._streams.put_step(message)
            elif isinstance(message, RequestFailed):
                error = RequestError if message.internal else ValueError
                self._streams.put(message.request_id, error(message.message))
            elif isinstance(message, CoreStats):
                self.core_stats = message
            elif isinstance(message, CoreFailed):
                self._core_error = message.message
        if self._is_stopping:
            self._streams.fail_all(EngineDeadError("The engine was shut down."))
            return
        self._process.join(EXIT_WAIT_S)
        cause = self._core_error or _exit_cause(self._process)
        logger.error("The engine core process died: %s", cause)
        self._streams.fail_all(EngineDeadError(f"The engine core process died: {cause}"))

    def _send_commands(self) -> None:
        while (command := self._commands.get()) is not None:
            try:
                self._command_writer.send(command)
            except OSError:
                return  # the core is gone; the receiver reports it
            except Exception as e:  # cannot be pickled: a bug; fail that request alone
                logger.exception("Cannot send %s to the engine core", type(command).__name__)
                if isinstance(command, AddRequest):
                    self._streams.put(command.request_id, RuntimeError(str(e)))


def _exit_cause(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "its output pipe closed"
    if code == -signal.SIGKILL:
        return (
            "killed by SIGKILL: most often the kernel's OOM killer, with the machine out of "
            "memory (dmesg says); a smaller model, --kv-cache-memory or --max-num-seqs needs less"
        )
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _import_front_end_code() -> None:
    """What the client reads once the core is ready (the tokenizer's code, the model's
    config): seconds of imports, taken while the core loads. xgrammar waits for the first
    grammar (lazy_structured_output.py)."""
    from transformers import AutoTokenizer  # noqa: F401

    import serve.models.loader  # noqa: F401
    import serve.models.tokenizer  # noqa: F401


def _logging_setup() -> tuple[int, str | None]:
    """The root logger's level and format, for the core process to log as this one does."""
    root = logging.getLogger()
    formats = [h.formatter._fmt for h in root.handlers if h.formatter is not None]
    return root.level, (formats[0] if formats else None)
