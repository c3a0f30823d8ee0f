"""How a model's dimensions split over tensor-parallel ranks, and the start-up check that
they can. Torch-free: the engine may check a config before any worker starts.

Attention heads split evenly. KV heads split evenly too, or, when there are more ranks
than KV heads, each KV head is replicated on `tp_size // num_kv_heads` consecutive ranks:

| num_kv_heads | tp_size | KV heads per rank | rank r holds KV heads       |
|--------------|---------|-------------------|-----------------------------|
| 8            | 2       | 4                 | 4r .. 4r + 3                |
| 2            | 2       | 1                 | r                           |
| 1            | 2       | 1 (replicated)    | 0                           |
| 2            | 4       | 1 (replicated)    | r // 2                      |

The vocabulary is padded up to a multiple of `VOCAB_PADDING`, then split into equal
contiguous row ranges; the padding rows are zero and their logits are cut off.
"""

from __future__ import annotations

from serve.models.arch_config import ArchConfig

VOCAB_PADDING = 64


def split_evenly(size: int, tp_size: int, what: str) -> int:
    """`size` / `tp_size`, the share of each rank; ValueError naming `what` if uneven."""
    if size % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide {what} {size}: choose a "
            "tensor-parallel size that divides this model's dimensions."
        )
    return size // tp_size


def pad_vocab_size(vocab_size: int, multiple: int = VOCAB_PADDING) -> int:
    return -(-vocab_size // multiple) * multiple


def num_kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    return max(1, num_kv_heads // tp_size)


def first_kv_head(num_kv_heads: int, tp_size: int, rank: int) -> int:
    """The first KV head rank `rank` holds (see the table above)."""
    num_replicas = max(1, tp_size // num_kv_heads)
    return (rank // num_replicas) * num_kv_heads_per_rank(num_kv_heads, tp_size)


def check_tensor_parallel(arch: ArchConfig, tp_size: int) -> None:
    """Raise ValueError, naming the numbers, when the model cannot split over `tp_size`
    ranks. Reads the normalised shape the model classes are built from."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be positive, got {tp_size}.")
    if tp_size > 1 and arch.model_impl == "transformers":
        raise ValueError(
            f"{arch.architecture} runs through the transformers backend, which runs at one "
            f"rank: tensor_parallel_size must be 1, got {tp_size}. Tensor parallelism needs "
            "an architecture serve implements natively (--model-impl native)."
        )
    split_evenly(arch.num_heads, tp_size, "num_attention_heads")
    if arch.num_kv_heads % tp_size and tp_size % arch.num_kv_heads:
        raise ValueError(
            f"num_key_value_heads {arch.num_kv_heads} must be divisible by "
            f"tensor_parallel_size {tp_size}, or tensor_parallel_size by num_key_value_heads."
        )
    for name, size in arch.split_sizes.items():
        split_evenly(size, tp_size, name)
    padded_vocab = pad_vocab_size(arch.vocab_size)
    if padded_vocab % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the padded vocabulary {padded_vocab} "
            f"(vocab_size {arch.vocab_size} padded to a multiple of {VOCAB_PADDING})."
        )
