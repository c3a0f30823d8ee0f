"""One rank's side of an executor: its `Worker` serving commands (messages.py).

    MultiprocExecutor ── commands pipe ──▶ run_worker_process ─▶ CommandRunner ─▶ Worker
                      ◀── replies pipe ───┘
    RayExecutor ── actor call ──▶ RayWorkerActor ─▶ CommandRunner ─▶ Worker

`CommandRunner` maps each command onto the `Worker` call it names, the same for a
spawned process and a Ray actor. A rank whose command raised reports `WorkerRaised`; a
spawned one then exits, since it is out of step with its peers (whose next collective
would hang) and the executor will send it nothing more.

A spawned rank never outlives the process that started it:
- it asks Linux for SIGKILL when its parent dies (`PR_SET_PDEATHSIG`), which holds even
  when the parent itself was SIGKILLed. Linux sends it when the *thread* that started the
  process exits, so an executor must be created by a thread that outlives it (the engine
  core's main thread does);
- it exits when its commands pipe reaches EOF (the parent closed it, or is gone);
- it ignores SIGINT and SIGTERM: Ctrl-C (or a service manager's SIGTERM) reaches the whole
  process group, and the parent decides.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from serve.executor.base import load_worker_class
from serve.executor.messages import (
    DetermineNumBlocks,
    Done,
    ExecuteModel,
    InitDeviceAndModel,
    InitializeCache,
    NumBlocks,
    Shutdown,
    StepDone,
    WorkerCommand,
    WorkerRaised,
    WorkerReply,
    decode_command,
    encode,
)
from serve.process_exit import exit_now
from serve.worker.worker import WorkerConfig

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class CommandRunner:
    """One rank's Worker, driven by commands. Builds the worker when constructed."""

    def __init__(self, config: WorkerConfig, worker_class: str) -> None:
        self.is_driver = config.is_driver
        self.worker = load_worker_class(worker_class)(config)

    def run(self, command: WorkerCommand) -> WorkerReply | None:
        """The command's reply; None for a step off the driver and for Shutdown."""
        if isinstance(command, ExecuteModel):
            output = self.worker.execute_model(command.scheduler_output)
            if not self.is_driver:
                return None
            if output is None:
                raise RuntimeError("The driver worker (rank 0) returned no ModelRunnerOutput.")
            return StepDone(output)
        if isinstance(command, InitDeviceAndModel):
            self.worker.init_device_and_model()
            return Done()
        if isinstance(command, DetermineNumBlocks):
            return NumBlocks(*self.worker.determine_num_blocks())
        if isinstance(command, InitializeCache):
            self.worker.initialize_cache(command.num_blocks, command.num_cpu_blocks)
            return Done()
        if isinstance(command, Shutdown):
            self.worker.shutdown()
            return None
        raise TypeError(f"Unknown worker command {type(command).__name__}.")


def raised(error: BaseException) -> WorkerRaised:
    return WorkerRaised(type(error).__name__, str(error), traceback.format_exc())


@dataclass(frozen=True)
class WorkerProcessArgs:
    """What a spawned rank is started with (pickled by multiprocessing, parent to child)."""

    config: WorkerConfig
    worker_class: str
    commands: Connection  # read end
    replies: Connection  # write end
    parent_pid: int
    num_cpu_threads: int  # torch's intra-op threads when the rank runs on the CPU
    log_level: int
    log_format: str | None


def run_worker_process(args: WorkerProcessArgs) -> None:
    """A spawned rank's entry point. Exits 0 after Shutdown or when the parent is gone,
    1 after reporting an error."""
    die_with_parent(args.parent_pid)
    for group_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(group_signal, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        # Every rank is on this machine: gloo's pairs talk over loopback, never a NIC.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    logging.basicConfig(
        level=args.log_level, **({"format": args.log_format} if args.log_format else {})
    )
    try:
        limit_cpu_threads(args.config, args.num_cpu_threads)
        runner = CommandRunner(args.config, args.worker_class)
        while True:
            command = decode_command(args.commands.recv_bytes())
            reply = runner.run(command)
            if isinstance(command, Shutdown):  # the worker has let go of what it held
                exit_now(0)
            if reply is not None:
                args.replies.send_bytes(encode(reply))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the executor is gone: nobody to serve
    except BaseException as e:
        try:
            args.replies.send_bytes(encode(raised(e)))
        except OSError:
            pass  # the executor is gone: nobody to tell
        sys.exit(1)


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:  # the parent died before we asked
        os._exit(0)


def limit_cpu_threads(config: WorkerConfig, num_threads: int) -> None:
    """On the CPU, the ranks share the machine's cores: give torch `num_threads` each."""
    device = config.engine.device
    if device.startswith("cuda"):
        return
    import torch

    if device == "auto" and torch.cuda.is_available():
        return
    torch.set_num_threads(num_threads)
