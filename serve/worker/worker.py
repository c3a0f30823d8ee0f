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

import gc
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serve.config import EngineConfig
from serve.step import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    import torch

    from serve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


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


def resolve_device(device: str, rank: int = 0) -> torch.device:
    """The device a rank computes on: `auto` is CUDA when there is one; with several
    ranks on CUDA, rank r takes the r-th GPU it can see (modulo the count: a Ray actor
    sees only its own GPU, as cuda:0)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was asked for, but CUDA is not available here.")
        if device == "cuda":
            return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(device)


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.model_runner: ModelRunner | None = None

    def init_device_and_model(self) -> None:
        import torch

        from serve.models.loader import load_hf_config
        from serve.worker.cpu_malloc import keep_freed_memory
        from serve.worker.model_runner import ModelRunner

        config = self.config
        device = resolve_device(config.engine.device, config.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            keep_freed_memory()  # (the executor gives co-located ranks their share of cores)
        if config.world_size > 1:
            from serve.distributed.parallel_state import init_tensor_parallel

            assert config.distributed_init_method is not None
            backend = "nccl" if device.type == "cuda" else "gloo"
            init_tensor_parallel(
                config.world_size, config.rank, config.distributed_init_method, backend
            )
        hf_config = load_hf_config(config.model_path)
        self.model_runner = ModelRunner(config, hf_config, device)

    def determine_num_blocks(self) -> tuple[int, int]:
        assert self.model_runner is not None
        self._make_device_current()
        return self.model_runner.determine_num_blocks()

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        assert self.model_runner is not None
        self._make_device_current()
        self.model_runner.initialize_cache(num_blocks, num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        assert self.model_runner is not None
        self._make_device_current()
        return self.model_runner.execute_model(scheduler_output)

    def _make_device_current(self) -> None:
        """Triton launches a kernel on the calling thread's current CUDA device, not on its
        tensors' (torch's ops follow the tensors). A step may run on another thread than
        the one that built the engine (AsyncEngine's loop), and another engine in the
        process may have made another GPU current: on a wrong device a kernel reads another
        GPU's addresses (an illegal memory access) or runs unordered with torch's ops."""
        assert self.model_runner is not None
        device = self.model_runner.device
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)

    def shutdown(self) -> None:
        """Let the model runner go (the model, the KV cache, the CUDA graphs) and leave the
        process group. Idempotent. With `uniproc` this process outlives the engine (an
        `LLM` still referenced after `shutdown()`), and a next engine here needs the memory."""
        runner, self.model_runner = self.model_runner, None
        if runner is not None and runner.step_sampler is not None:
            runner.step_sampler.grammars.close()
        is_cuda = runner is not None and runner.device.type == "cuda"
        del runner  # the last reference to it
        if is_cuda:
            import torch

            gc.collect()  # tensors held in reference cycles, then torch's cached blocks
            torch.cuda.empty_cache()
        if self.config.world_size > 1:
            from serve.distributed.parallel_state import destroy_tensor_parallel

            destroy_tensor_parallel()
