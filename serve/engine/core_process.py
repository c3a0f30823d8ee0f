"""The engine core's own process: the child side of `EngineCoreClient`.

    parent (API process)                         child (this module)
    commands ── AddRequest / AbortRequest / ─────────▶ run_core_loop → EngineCore.step()
                StopSequence / Stop
    outputs  ◀── CoreReady | CoreFailed ──────────── once, after building EngineCore
             ◀── list[RequestDelta] ──────────────── one message per step (token ids)
             ◀── RequestFailed ───────────────────── a request that failed when added
             ◀── CoreStats ───────────────────────── for /metrics, while busy and when idle
             ◀── CoreFailed ──────────────────────── the loop died (then exit 1)

Both are one-way `multiprocessing` pipes of plain data: a step's deltas as MessagePack,
the rest pickled (messages.py). The child sends each request's new tokens since its last
message (output_deltas.py); the parent decodes the text and applies stop strings. The
child ignores SIGINT and SIGTERM: Ctrl-C reaches the whole process group, and so does a
service manager's SIGTERM (systemd's default), and the parent decides when the core stops
(Stop once it has drained, or SIGKILL). When the parent dies, its pipe ends close: the
child's next read or write fails and it exits.
Nothing here imports FastAPI or the API, and nothing heavy at import: the API process
imports this module for `run_core_process` before it starts the child, and the model's
modules (torch, transformers, xgrammar: seconds) load in the child alone.
"""

from __future__ import annotations

import logging
import signal
import sys
from multiprocessing.connection import Connection

from serve.config import EngineConfig
from serve.engine.messages import (
    Command,
    CoreFailed,
    CoreReady,
    CoreStats,
    RequestFailed,
    encode_step,
)
from serve.engine.protocol import request_error_message
from serve.process_exit import exit_now
from serve.scheduler.output_deltas import RequestDelta

logger = logging.getLogger(__name__)

# What a start-up error may be, as the parent re-raises it: its most specific class here.
STARTUP_ERROR_TYPES = (FileNotFoundError, OSError, ValueError)


class _PipeCommands:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def get(self, block: bool, timeout: float | None = None) -> Command | None:
        if self.conn.poll(timeout if block else 0):
            return self.conn.recv()  # EOFError once the parent is gone
        return None


class _PipeReplies:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def put_step(self, deltas: list[RequestDelta]) -> None:
        self.conn.send_bytes(encode_step(deltas))

    def request_failed(self, request_id: str, error: Exception) -> None:
        if isinstance(error, ValueError):
            self.conn.send(RequestFailed(request_id, str(error)))
        else:
            self.conn.send(RequestFailed(request_id, request_error_message(error), True))

    def put_stats(self, stats: CoreStats) -> None:
        self.conn.send(stats)


def run_core_process(
    config: EngineConfig,
    commands: Connection,
    outputs: Connection,
    log_level: int,
    log_format: str | None,
) -> None:
    """The child's entry point (a `spawn` target). Exits 0 after Stop or when the parent
    is gone, 1 when the engine could not start or its loop died."""
    for group_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(group_signal, signal.SIG_IGN)
    logging.basicConfig(level=log_level, **({"format": log_format} if log_format else {}))

    try:
        from serve.engine.core import EngineCore
        from serve.engine.core_loop import run_core_loop

        core = EngineCore(config)
    except BaseException as e:
        kind = next((t for t in STARTUP_ERROR_TYPES if isinstance(e, t)), None)
        if kind is None:  # not a user's mistake: show where it happened
            logger.exception("The engine core failed to start")
        send_quietly(outputs, CoreFailed((kind or type(e)).__name__, str(e)))
        sys.exit(1)
    ready = CoreReady(
        core.model_path,
        core.max_model_len,
        core.vocab_size,
        config.model.max_logprobs,
        frozenset(core.eos_token_ids),
        core.pooling,
    )
    try:
        outputs.send(ready)
        run_core_loop(core, _PipeCommands(commands), _PipeReplies(outputs))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone: nobody to serve
    except BaseException as e:
        logger.exception("The engine core loop died")
        send_quietly(outputs, CoreFailed(type(e).__name__, repr(e)))
        core.shutdown()
        sys.exit(1)
    core.shutdown()  # its workers go with it
    exit_now(0)  # not the interpreter's teardown: nothing is left to close


def send_quietly(conn: Connection, message: object) -> None:
    """Send unless the other end is gone (then there is nobody to tell)."""
    try:
        conn.send(message)
    except OSError:
        pass
