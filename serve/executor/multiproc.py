"""MultiprocExecutor: one spawned process per tensor-parallel rank, on this machine.

    execute_model ─ encode once ─┬▶ commands pipe ─▶ rank 0 ─┐ Worker.execute_model on
                                 └▶ commands pipe ─▶ rank r ─┘ every rank, in step
                  ◀── StepDone ──── replies pipe ◀── rank 0
                  ◀── WorkerRaised ─ replies pipe ◀── any rank (which then exits)
                  ◀── its exit ──── process sentinel ◀── any rank (killed, crashed)

While it waits for a reply the executor waits on every rank's replies pipe and process
sentinel together (`multiprocessing.connection.wait`), so a rank that raises or dies
fails the call at once, even while the other ranks are blocked in a collective that
will never complete (after up to FAILURE_GRACE_S for the other ranks' failures, to blame
the right one: failures.py). From then on every call raises WorkerFailedError;
`shutdown()` stops what is left, terminating ranks that are stuck (they never read a
request).

Start-up runs each of `init_device_and_model`, `determine_num_blocks` and
`initialize_cache` on every rank before the next, each rank holding the smallest block
counts of all; a rank that fails fails the constructor, which leaves no process behind.

The ranks' rendezvous is `tcp://127.0.0.1:<free port>`. The pipes carry msgspec-encoded
messages (messages.py), private to this process tree. A step is written to each rank's
pipe in turn: a rank reads its pipe whenever it is not running a step, so a write never
waits for long (a rank that hung outside a collective would block a write larger than
the pipe's buffer: a Worker must not hang).

Not thread-safe: one thread (the engine core's loop) makes every call.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import socket
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from serve.executor.base import DEFAULT_WORKER_CLASS, Executor
from serve.executor.failures import FAILURE_GRACE_S, FailureLatch, RankFailure
from serve.executor.messages import (
    ExecuteModel,
    Shutdown,
    StepDone,
    WorkerCommand,
    WorkerRaised,
    WorkerReply,
    decode_reply,
    encode,
)
from serve.executor.worker_process import WorkerProcessArgs, run_worker_process
from serve.step import ModelRunnerOutput, SchedulerOutput
from serve.worker.worker import WorkerConfig

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0  # for healthy ranks to run Worker.shutdown() and exit
EXIT_TIMEOUT_S = 1.0  # for a rank whose pipe closed to finish exiting (to read its cause)


@dataclass
class _Rank:
    rank: int
    process: BaseProcess
    commands: Connection  # write end
    replies: Connection  # read end


class MultiprocExecutor(Executor):
    def __init__(
        self, worker_config: WorkerConfig, worker_class: str = DEFAULT_WORKER_CLASS
    ) -> None:
        super().__init__(worker_config, worker_class)
        self._ranks: list[_Rank] = []
        self._latch = FailureLatch()
        world_size = worker_config.engine.parallel.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        atexit.register(self.shutdown)  # before multiprocessing's exit hook joins the ranks
        try:
            context = multiprocessing.get_context("spawn")  # never fork a process with torch
            for rank in range(world_size):
                config = replace(
                    worker_config,
                    rank=rank,
                    world_size=world_size,
                    distributed_init_method=init_method,
                )
                self._ranks.append(_start_rank(context, config, worker_class))
        except BaseException:
            self.shutdown()
            raise
        self._start_every_rank(self._call_every_rank)

    @property
    def worker_pids(self) -> list[int | None]:
        """Each rank's process id, by rank (for logs, and tests that kill one)."""
        return [r.process.pid for r in self._ranks]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._latch.raise_if_set()
        self._send_to_every_rank(ExecuteModel(scheduler_output))
        reply = self._receive(from_ranks={0})[0]
        if not isinstance(reply, StepDone):
            raise self._latch.set([_unexpected(0, reply)])
        return reply.output

    def check_health(self) -> None:
        self._latch.raise_if_set()
        failures = []
        for rank in self._ready_ranks(self._ranks, timeout=0):
            message = self._read(rank)
            failures.append(
                message if isinstance(message, RankFailure) else _unexpected(rank.rank, message)
            )
        if failures:
            raise self._latch.set(self._with_later_failures(failures))

    def shutdown(self) -> None:
        """Ask every rank to exit; kill those that do not in time (after a failure, at
        once: they are likely stuck in a collective). Ranks ignore SIGTERM. Idempotent."""
        if self._latch.is_shut_down:
            return
        self._latch.is_shut_down = True
        atexit.unregister(self.shutdown)
        shutdown = encode(Shutdown())
        for rank in self._ranks:
            _send_without_blocking(rank.commands, shutdown)
            rank.commands.close()  # EOF for a rank that missed Shutdown
        deadline = time.monotonic() + (0.0 if self._latch.error else SHUTDOWN_TIMEOUT_S)
        for rank in self._ranks:
            rank.process.join(max(0.0, deadline - time.monotonic()))
        stragglers = [r.process for r in self._ranks if r.process.exitcode is None]
        if stragglers and not self._latch.error:
            logger.warning("%d worker(s) did not stop in time; killing them.", len(stragglers))
        for process in stragglers:
            process.kill()
            process.join()
        for rank in self._ranks:
            rank.replies.close()

    # -- start-up and steps --------------------------------------------------------------

    def _call_every_rank(self, command: WorkerCommand) -> list[WorkerReply]:
        self._send_to_every_rank(command)
        replies = self._receive(from_ranks=set(range(len(self._ranks))))
        return [replies[r] for r in range(len(self._ranks))]

    def _send_to_every_rank(self, command: WorkerCommand) -> None:
        """Encode once, write to each rank. A rank that is gone is reported by `_receive`."""
        data = encode(command)
        for rank in self._ranks:
            try:
                rank.commands.send_bytes(data)
            except OSError:
                return  # its process has exited: its sentinel says so

    def _receive(self, from_ranks: set[int]) -> dict[int, WorkerReply]:
        """One reply from each of `from_ranks`; WorkerFailedError as soon as any rank
        (expected to reply or not) raises or dies."""
        replies: dict[int, WorkerReply] = {}
        while len(replies) < len(from_ranks):
            failures = []
            for rank in self._ready_ranks(self._ranks, timeout=None):
                message = self._read(rank)
                if isinstance(message, RankFailure):
                    failures.append(message)
                elif rank.rank in from_ranks and rank.rank not in replies:
                    replies[rank.rank] = message
                else:
                    failures.append(_unexpected(rank.rank, message))
            if failures:
                raise self._latch.set(self._with_later_failures(failures))
        return replies

    # -- failures ------------------------------------------------------------------------

    def _with_later_failures(self, failures: list[RankFailure]) -> list[RankFailure]:
        """`failures`, then the other ranks' that arrive within FAILURE_GRACE_S (failures.py
        says why), in the order they arrive."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        failed = {f.rank for f in failures}
        while len(failed) < len(self._ranks) and (left_s := deadline - time.monotonic()) > 0:
            others = [r for r in self._ranks if r.rank not in failed]
            for rank in self._ready_ranks(others, left_s):
                message = self._read(rank)
                if isinstance(message, RankFailure):  # else a late reply: the step failed
                    failures.append(message)
                    failed.add(rank.rank)
        return failures

    @staticmethod
    def _ready_ranks(ranks: list[_Rank], timeout: float | None) -> list[_Rank]:
        """Those of `ranks` with something to read on their replies pipe, or whose
        process exited."""
        watched = [r.replies for r in ranks] + [r.process.sentinel for r in ranks]
        ready = set(wait(watched, timeout))
        return [r for r in ranks if r.replies in ready or r.process.sentinel in ready]

    def _read(self, rank: _Rank) -> WorkerReply | RankFailure:
        """The rank's next reply; or, when it has failed, why (what it sent before it
        exited explains more than its exit code)."""
        try:
            if rank.replies.poll():
                reply = decode_reply(rank.replies.recv_bytes())
                if not isinstance(reply, WorkerRaised):
                    return reply
                logger.error("Worker rank %d raised:\n%s", rank.rank, reply.traceback)
                return RankFailure(
                    rank.rank, f"raised {reply.error_type}: {reply.message}", reply.error_type
                )
        except (EOFError, OSError):
            pass  # the pipe closed: the process is exiting
        rank.process.join(EXIT_TIMEOUT_S)
        return RankFailure(rank.rank, f"died ({_exit_cause(rank.process)})", None)


def _start_rank(
    context: multiprocessing.context.SpawnContext, config: WorkerConfig, worker_class: str
) -> _Rank:
    command_reader, command_writer = context.Pipe(duplex=False)
    reply_reader, reply_writer = context.Pipe(duplex=False)
    level, log_format = _logging_setup()
    args = WorkerProcessArgs(
        config,
        worker_class,
        command_reader,
        reply_writer,
        parent_pid=os.getpid(),
        num_cpu_threads=max(1, (os.cpu_count() or 1) // config.world_size),
        log_level=level,
        log_format=log_format,
    )
    process = context.Process(
        target=run_worker_process, args=(args,), name=f"serve-worker-{config.rank}", daemon=True
    )
    process.start()
    # Only the child holds these ends now, so its exit reads as EOF here, and ours there.
    command_reader.close()
    reply_writer.close()
    return _Rank(config.rank, process, command_writer, reply_reader)


def _send_without_blocking(conn: Connection, data: bytes) -> None:
    """Send a small message unless the rank is gone or not reading (a full pipe: it will
    be terminated). A message under PIPE_BUF is written whole or not at all."""
    try:
        os.set_blocking(conn.fileno(), False)
        conn.send_bytes(data)
    except OSError:
        pass


def _unexpected(rank: int, reply: WorkerReply) -> RankFailure:
    return RankFailure(rank, f"sent an unexpected {type(reply).__name__}", type(reply).__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_cause(process: BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "its pipe closed"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _logging_setup() -> tuple[int, str | None]:
    """The root logger's level and format, for the ranks to log as this process does."""
    root = logging.getLogger()
    formats = [h.formatter._fmt for h in root.handlers if h.formatter is not None]
    return root.level, (formats[0] if formats else None)
