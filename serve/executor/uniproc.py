"""UniprocExecutor: one worker (rank 0 of 1) in the engine core's own process and thread.

No process group, no messages: the SchedulerOutput is handed to the worker as it is. What
it shares with the other executors is the contract: the same start-up sequence, and a
worker that raised fails this call and every later one with WorkerFailedError (the
original exception chained), since its state may be half updated.
"""

from __future__ import annotations

from dataclasses import replace

from serve.executor.base import DEFAULT_WORKER_CLASS, Executor, load_worker_class
from serve.executor.failures import FailureLatch, RankFailure
from serve.step import ModelRunnerOutput, SchedulerOutput
from serve.worker.worker import WorkerConfig


class UniprocExecutor(Executor):
    def __init__(
        self, worker_config: WorkerConfig, worker_class: str = DEFAULT_WORKER_CLASS
    ) -> None:
        super().__init__(worker_config, worker_class)
        self._latch = FailureLatch()
        config = replace(worker_config, rank=0, world_size=1, distributed_init_method=None)
        self.worker = load_worker_class(worker_class)(config)
        self.worker.init_device_and_model()
        self.num_blocks, self.num_cpu_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(self.num_blocks, self.num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._latch.raise_if_set()
        try:
            output = self.worker.execute_model(scheduler_output)
            if output is None:
                raise RuntimeError("The driver worker (rank 0) returned no ModelRunnerOutput.")
        except Exception as e:
            failure = RankFailure(0, f"raised {type(e).__name__}: {e}", type(e).__name__)
            raise self._latch.set([failure]) from e
        return output

    def check_health(self) -> None:
        """Nothing to check: the worker lives and dies with this process."""

    def shutdown(self) -> None:
        if not self._latch.is_shut_down:
            self._latch.is_shut_down = True
            self.worker.shutdown()
