"""UniprocExecutor: the one worker runs in the engine core's own process and thread."""

from __future__ import annotations

from dataclasses import replace

from serve.executor.base import DEFAULT_WORKER_CLASS, Executor, load_worker_class
from serve.step import ModelRunnerOutput, SchedulerOutput
from serve.worker.worker import WorkerConfig


class UniprocExecutor(Executor):
    def __init__(self, worker_config: WorkerConfig, worker_class: str = DEFAULT_WORKER_CLASS):
        super().__init__(worker_config, worker_class)
        config = replace(worker_config, rank=0, world_size=1, distributed_init_method=None)
        self.worker = load_worker_class(worker_class)(config)
        self.worker.init_device_and_model()
        self.num_blocks, self.num_cpu_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(self.num_blocks, self.num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self.worker.execute_model(scheduler_output)
        assert output is not None  # rank 0 always answers
        return output

    def check_health(self) -> None:
        pass  # the worker is this thread: if it failed, the step raised

    def shutdown(self) -> None:
        self.worker.shutdown()
