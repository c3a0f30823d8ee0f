"""The executor interface: one engine's workers, one per tensor-parallel rank.

    EngineCore ── SchedulerOutput ──▶ Executor ──▶ Worker rank 0 (the driver: samples)
               ◀── ModelRunnerOutput ──┘     └──▶ Worker rank 1..N-1 (compute their shards)

Three kinds, chosen by `--distributed-executor-backend`:
- `uniproc` (uniproc.py): one worker in the engine core's own process and thread;
- `mp` (multiproc.py): one process per rank on this machine, torch.distributed (gloo on
  CPU, NCCL on CUDA) between them;
- `ray` (ray_executor.py): workers as Ray actors in a placement group, for models that
  span machines.

Every kind starts its workers the same way: build each rank's `Worker`, initialise the
device, the process group and the model on every rank, ask each rank how many KV blocks
it can hold, and give every rank the smallest number, so that one block table addresses
every rank's cache. Steps then go to every rank; the driver's output comes back.
"""

from __future__ import annotations

import abc
import importlib
import logging
from collections.abc import Callable, Sequence

from serve.executor.messages import (
    DetermineNumBlocks,
    InitDeviceAndModel,
    InitializeCache,
    NumBlocks,
    WorkerCommand,
    WorkerReply,
)
from serve.step import ModelRunnerOutput, SchedulerOutput
from serve.worker.worker import WorkerConfig

logger = logging.getLogger(__name__)

DEFAULT_WORKER_CLASS = "serve.worker.worker.Worker"


class WorkerFailedError(RuntimeError):
    """A worker died or raised: the engine cannot go on (its ranks are out of step).

    `rank`: the failed rank (the first, when several failed); `error_type`: the class name
    of what it raised, None when it died without a word (killed, crashed)."""

    def __init__(self, message: str, rank: int | None = None, error_type: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type


class Executor(abc.ABC):
    """Owns the workers' lives: starts them, sends them steps, stops them.

    `num_blocks` / `num_cpu_blocks`: KV blocks every rank holds on its device and in its
    CPU swap space, fixed once the workers have started.
    """

    num_blocks: int
    num_cpu_blocks: int

    def __init__(self, worker_config: WorkerConfig, worker_class: str = DEFAULT_WORKER_CLASS):
        self.worker_config = worker_config
        self.worker_class = worker_class

    @staticmethod
    def create(worker_config: WorkerConfig, worker_class: str = DEFAULT_WORKER_CLASS) -> Executor:
        """The executor `worker_config.engine.parallel` asks for, with its workers started.
        A rank that could not start for a reason the user can fix (ValueError: the cache
        too small; FileNotFoundError, OSError: the weights) raises that type, with the
        rank's message, as a single rank would."""
        backend = worker_config.engine.parallel.executor_backend
        module_name, class_name = _EXECUTORS[backend]
        executor_class = getattr(importlib.import_module(module_name), class_name)
        try:
            return executor_class(worker_config, worker_class)
        except WorkerFailedError as e:
            user_error = _USER_ERRORS.get(e.error_type or "")
            if user_error is None:
                raise
            raise user_error(str(e)) from e

    def _start_every_rank(
        self, call_every_rank: Callable[[WorkerCommand], Sequence[WorkerReply | None]]
    ) -> None:
        """The start-up every multi-rank kind shares: the device, the group and the model
        on every rank, then the smallest block counts of all ranks on every rank. A failure
        stops whatever started (`shutdown`) before it propagates."""
        try:
            call_every_rank(InitDeviceAndModel())
            counts = call_every_rank(DetermineNumBlocks())
            assert all(isinstance(c, NumBlocks) for c in counts)
            self.num_blocks = min(c.num_blocks for c in counts)  # type: ignore[union-attr]
            self.num_cpu_blocks = min(c.num_cpu_blocks for c in counts)  # type: ignore[union-attr]
            call_every_rank(InitializeCache(self.num_blocks, self.num_cpu_blocks))
        except WorkerFailedError as e:
            self.shutdown()
            raise WorkerFailedError(
                f"The workers could not start: {e}", e.rank, e.error_type
            ) from None
        except BaseException:
            self.shutdown()
            raise

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; the driver's output. Raises WorkerFailedError when
        a worker died or raised (the engine must stop)."""

    @abc.abstractmethod
    def check_health(self) -> None:
        """Raise WorkerFailedError if a worker has died (an idle engine asks now and then)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every worker; no process is left behind. Idempotent."""


_USER_ERRORS: dict[str, type[Exception]] = {
    kind.__name__: kind for kind in (ValueError, FileNotFoundError, OSError)
}

_EXECUTORS = {
    "uniproc": ("serve.executor.uniproc", "UniprocExecutor"),
    "mp": ("serve.executor.multiproc", "MultiprocExecutor"),
    "ray": ("serve.executor.ray_executor", "RayExecutor"),
}


def load_worker_class(qualified_name: str) -> type:
    """`package.module.Class` -> the class (tests pass their own workers)."""
    module_name, _, class_name = qualified_name.rpartition(".")
    return getattr(importlib.import_module(module_name), class_name)
