"""UniprocExecutor: rank 0 of 1 in this process, no process group; a worker that raised
fails that call and every later one."""

from __future__ import annotations

import pytest
from executor.fake_workers import digest, num_blocks_of

from serve.config import EngineConfig
from serve.executor.base import Executor, WorkerFailedError
from serve.executor.uniproc import UniprocExecutor
from serve.step import ScheduledSequence, SchedulerOutput
from serve.worker.worker import WorkerConfig

CONFIG = WorkerConfig(EngineConfig(device="cpu"), model_path="unused", eos_token_ids=(0,))


def step(num_seqs: int) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled=[ScheduledSequence(i, 10, 1, 0, [], True) for i in range(num_seqs)]
    )


def test_steps_run_on_rank_0_in_this_process():
    executor = Executor.create(CONFIG, "executor.fake_workers.EchoWorker")  # tp 1: uniproc
    assert isinstance(executor, UniprocExecutor)
    assert executor.worker.config.distributed_init_method is None
    assert (executor.num_blocks, executor.num_cpu_blocks) == num_blocks_of(0)
    for index in range(3):
        scheduler_output = step(index + 1)
        output = executor.execute_model(scheduler_output)
        assert output.seq_ids == list(range(index + 1))
        assert output.token_ids == [index, digest(scheduler_output), *num_blocks_of(0)]
    executor.check_health()
    executor.shutdown()
    executor.shutdown()
    with pytest.raises(WorkerFailedError, match="shut down"):
        executor.execute_model(step(1))


def test_a_worker_that_raises_fails_every_later_call():
    executor = Executor.create(CONFIG, "executor.fake_workers.RaisingDriverWorker")
    executor.execute_model(step(1))
    message = "Worker rank 0 raised RuntimeError: injected failure on rank 0 at step 1"
    with pytest.raises(WorkerFailedError, match=message) as raised:
        executor.execute_model(step(1))
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert (raised.value.rank, raised.value.error_type) == (0, "RuntimeError")
    with pytest.raises(WorkerFailedError, match=message):
        executor.execute_model(step(1))
    executor.shutdown()
