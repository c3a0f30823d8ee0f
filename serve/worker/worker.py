"""Worker: one tensor-parallel rank's device, process group, model, KV cache and sampler.

An executor builds one `Worker` per rank (in its own process, or in the engine core's for
`uniproc`) and calls, on every rank alike:

    init_device_and_model()          the device, torch.distributed, the model's shard
    determine_num_blocks()           KV blocks this rank has room for (device, CPU swap)
    initialize_cache(n, n_cpu)       the KV cache, the same size on every rank
    execute_model(scheduler_output)  once per step: rank 0 returns its ModelRunnerOutput,
                                     the other ranks None

Every method but `__init__` may run collectives, so every rank must call them in the same
order. Nothing here decides who runs: the SchedulerOutput says, the worker computes.
"""

from __future__ import annotations

from dataclasses import dataclass

from serve.config import EngineConfig
from serve.step import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class WorkerConfig:
    """What a rank needs to start: plain data, sent to worker processes and Ray actors."""

    engine: EngineConfig
    model_path: str  # a resolved local directory with config.json and weights
    eos_token_ids: tuple[int, ...]  # masked until min_tokens; the grammars' stop tokens
    rank: int = 0
    world_size: int = 1
    # torch.distributed's rendezvous ("tcp://127.0.0.1:29500"); None for a single rank.
    distributed_init_method: str | None = None

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and returns each step's output."""
        return self.rank == 0


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config

    def init_device_and_model(self) -> None:
        raise NotImplementedError

    def determine_num_blocks(self) -> tuple[int, int]:
        raise NotImplementedError

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        raise NotImplementedError

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass
