"""Frozen configuration, built once (from the CLI or `LLM(...)`) and passed explicitly.

No torch here: the scheduler and the block allocator import this module. Numbers found at
run time (the number of KV blocks, the effective context length) belong to their owners.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1 << 30

DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "pt")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how.

    `model` is a local directory with `config.json` and weights, a `.gguf` file, an HF
    repo id already in the local HF cache, or None for the default model.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own limit, fitted to the cache
    seed: int = 0
    # "auto": safetensors, else pickled `.bin` if allowed; "pt": only pickled `.bin`.
    load_format: str = "auto"
    # The most `logprobs` / `prompt_logprobs` alternatives a request may ask for.
    max_logprobs: int = 20
    # Pickled (`.bin`) checkpoints can run arbitrary code when loaded: never without this.
    allow_pickle_weights: bool = False

    def __post_init__(self) -> None:
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}.")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}.")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}."
            )
        if self.load_format == "pt" and not self.allow_pickle_weights:
            raise ValueError(
                "load_format 'pt' loads pickled weights, which can run arbitrary code when "
                "loaded: add --allow-pickle-weights (allow_pickle_weights=True) if you trust them."
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}.")


DEFAULT_SWAP_SPACE_BYTES = 4 * GiB
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # CPU: bytes of KV cache to allocate (default 4 GiB).
    kv_cache_memory_bytes: int | None = None
    # CUDA: fraction of total GPU memory the engine may use, weights and activations included.
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    # CPU memory for blocks swapped out by preemption (pinned when the device is CUDA).
    swap_space_bytes: int = DEFAULT_SWAP_SPACE_BYTES
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space_bytes}.")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory_bytes}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be positive, got {self.num_gpu_blocks_override}."
            )


DEFAULT_CPU_KV_CACHE_BYTES = 4 * GiB
# A step's token budget bounds how long a prompt chunk holds up the running decodes. On CPU
# a step costs about its token count in compute (~2.5 s for 512 tokens of the default
# model on 2 cores), so the budget stays small; on a GPU, 8192 tokens take milliseconds.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 8192, "cpu": 512}


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    # None: a per-device default (DEFAULT_MAX_NUM_BATCHED_TOKENS), resolved by EngineConfig.
    max_num_batched_tokens: int | None = None
    # None: swap groups with several sequences, recompute single ones (vLLM's rule).
    preemption_mode: str | None = None
    # On: a prompt longer than what is left of a step's token budget is computed in chunks
    # over several steps. Off: a prompt is only ever computed whole, in one step.
    enable_chunked_prefill: bool = True
    # On: while a step's forward runs, a helper thread builds the previous step's token
    # deltas (they come one step later) and schedules the next step and builds its inputs,
    # its sampled tokens filled in when it runs. Off: one step at a time.
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.preemption_mode not in (None, *PREEMPTION_MODES):
            raise ValueError(
                f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; "
                f"got {self.preemption_mode!r}."
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}."
            )


EXECUTOR_BACKENDS = ("uniproc", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks run the model, and what runs them (executor/base.py)."""

    tensor_parallel_size: int = 1
    # None: `uniproc` for one rank, `mp` (a process per rank) for more.
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}."
            )
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}; "
                f"got {backend!r}."
            )
        if backend == "uniproc" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"distributed_executor_backend 'uniproc' runs one rank, but "
                f"tensor_parallel_size is {self.tensor_parallel_size}: use 'mp' or 'ray'."
            )

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uniproc" if self.tensor_parallel_size == 1 else "mp"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"

    @classmethod
    def create(
        cls,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        load_format: str = "auto",
        max_logprobs: int = 20,
        allow_pickle_weights: bool = False,
        block_size: int = 16,
        kv_cache_memory: int | str | None = None,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        swap_space: float = DEFAULT_SWAP_SPACE_BYTES / GiB,
        enable_prefix_caching: bool = True,
        preemption_mode: str | None = None,
        enable_chunked_prefill: bool = True,
        async_scheduling: bool = True,
        tensor_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        device: str = "auto",
    ) -> EngineConfig:
        """The flat keyword form that `LLM(...)` and the CLI share. `swap_space` is in GiB,
        as vLLM's flag is."""
        kv_bytes = parse_memory_size(kv_cache_memory) if kv_cache_memory is not None else None
        return cls(
            model=ModelConfig(
                model,
                tokenizer,
                dtype,
                max_model_len,
                seed,
                load_format,
                max_logprobs,
                allow_pickle_weights,
            ),
            cache=CacheConfig(
                block_size,
                kv_bytes,
                gpu_memory_utilization,
                num_gpu_blocks_override,
                int(swap_space * GiB),
                enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs,
                max_num_batched_tokens,
                preemption_mode,
                enable_chunked_prefill,
                async_scheduling,
            ),
            parallel=ParallelConfig(tensor_parallel_size, distributed_executor_backend),
            device=device,
        )


_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "kb": 1000,
    "mib": 1 << 20,
    "mb": 1000**2,
    "gib": GiB,
    "gb": 1000**3,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": GiB,
}


def parse_memory_size(value: int | float | str) -> int:
    """Bytes from `4GiB`, `512MiB`, `1.5G` or a plain number of bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number) :]
    if not number or unit not in _UNITS:
        raise ValueError(f"Cannot read {value!r} as a memory size; write e.g. 4GiB or 512MiB.")
    return int(float(number) * _UNITS[unit])
