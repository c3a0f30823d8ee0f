"""Workers without a model for the executor tests: a gloo group and one collective a step.

`EchoWorker` on every rank digests each SchedulerOutput it receives; the ranks all-gather
(step index, digest, cache sizes), and rank 0 returns the gathered rows as `token_ids`:
the test sees what every rank saw, in which order. Since every step is a collective, a
rank that does not take part leaves the others blocked, as a real tensor-parallel step
would. The subclasses inject one fault each, on rank 1.

Passed to executors by qualified name (`executor.fake_workers.EchoWorker`): tests/ is on
the path, and spawned processes inherit it.
"""

from __future__ import annotations

import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from serve.step import ModelRunnerOutput, SchedulerOutput
from serve.worker.worker import Worker

ROW_WIDTH = 4  # one row per rank: [step index, digest, num_blocks, num_cpu_blocks]
GROUP_TIMEOUT = timedelta(seconds=60)  # a hung test fails in a minute, not gloo's 30


def digest(scheduler_output: SchedulerOutput) -> int:
    return zlib.crc32(repr(scheduler_output).encode())


def num_blocks_of(rank: int) -> tuple[int, int]:
    """Different on each rank, the smallest device count on the last rank and the smallest
    CPU count on rank 0, so that the minimum comes from more than one rank."""
    return 1000 - 10 * rank, 100 + rank


class EchoWorker(Worker):
    def init_device_and_model(self) -> None:
        self.num_steps = 0
        self.cache_sizes = (0, 0)
        if self.config.distributed_init_method is not None:
            dist.init_process_group(
                "gloo",
                init_method=self.config.distributed_init_method,
                rank=self.config.rank,
                world_size=self.config.world_size,
                timeout=GROUP_TIMEOUT,
            )

    def determine_num_blocks(self) -> tuple[int, int]:
        return num_blocks_of(self.config.rank)

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_sizes = (num_blocks, num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self.before_collective()
        row = torch.tensor([self.num_steps, digest(scheduler_output), *self.cache_sizes])
        rows = [torch.zeros_like(row) for _ in range(self.config.world_size)]
        if dist.is_initialized():
            dist.all_gather(rows, row)
        else:
            rows = [row]
        self.num_steps += 1
        if not self.config.is_driver:
            return None
        return ModelRunnerOutput(
            seq_ids=[s.seq_id for s in scheduler_output.scheduled],
            token_ids=torch.cat(rows).tolist(),
        )

    def before_collective(self) -> None:
        """Where the subclasses inject their faults."""

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class FailsToStartWorker(EchoWorker):
    """Rank 1 raises before joining the group: rank 0 waits in the rendezvous."""

    def init_device_and_model(self) -> None:
        if self.config.rank == 1:
            raise ValueError("rank 1 cannot start: injected")
        super().init_device_and_model()


class RaisesAtStep2Worker(EchoWorker):
    """Rank 1 raises in its third step, before the collective rank 0 then waits in."""

    def before_collective(self) -> None:
        if self.config.rank == 1 and self.num_steps == 2:
            raise RuntimeError("injected failure on rank 1 at step 2")


class StallsAtStep1Worker(EchoWorker):
    """Rank 1 sleeps through its second step, so that rank 0 waits in the collective
    while the test kills rank 1."""

    def before_collective(self) -> None:
        if self.config.rank == 1 and self.num_steps == 1:
            time.sleep(60)


class RaisingDriverWorker(EchoWorker):
    """Rank 0 raises in its second step (for the uniproc executor, which runs rank 0)."""

    def before_collective(self) -> None:
        if self.config.rank == 0 and self.num_steps == 1:
            raise RuntimeError("injected failure on rank 0 at step 1")
