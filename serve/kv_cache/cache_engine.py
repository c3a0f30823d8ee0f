"""The KV cache tensors: one (key, value) pair per attention layer on the device, and the
same in CPU memory as the swap space that preemption by swapping moves blocks into.

A model whose keys are its values (`shared_kv`: DeepSeek's latent cache) gets one tensor
per layer, held as both halves of the pair; its blocks cost half."""

from __future__ import annotations

import math
import mmap
import sys

import torch

# Linux's flag (0x4000 on every architecture serve runs on); Python's mmap module names it
# from 3.13 on.
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def kv_bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    shared_kv: bool = False,
) -> int:
    element_size = torch.tensor([], dtype=dtype).element_size()
    tensors = 1 if shared_kv else 2
    return tensors * num_layers * block_size * num_kv_heads * head_dim * element_size


class CacheEngine:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_cpu_blocks: int = 0,
        shared_kv: bool = False,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_cpu_blocks = num_cpu_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)

        def pair(allocate):  # (key, value): one tensor twice where the keys are the values
            key = allocate()
            return (key, key) if shared_kv else (key, allocate())

        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            pair(lambda: self._allocate(shape, dtype, device)) for _ in range(num_layers)
        ]
        # Uninitialised: a swapped-in block is always one that was swapped out. Pinned on
        # CUDA so the copies are asynchronous DMA.
        cpu_shape = (num_cpu_blocks, block_size, num_kv_heads, head_dim)
        swap_tensor = (
            (lambda: torch.empty(cpu_shape, dtype=dtype, pin_memory=True))
            if device.type == "cuda"
            else (lambda: unreserved_empty(cpu_shape, dtype))
        )
        self.swap_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            pair(swap_tensor) for _ in range(num_layers if num_cpu_blocks else 0)
        ]

    @staticmethod
    def _allocate(
        shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:  # [num_blocks, block_size, num_kv_heads, head_dim]
        """Indexed [block, offset, head, dim] everywhere; stored heads-first on CPU, where
        gathering a sequence's blocks then yields each head's context matrix contiguously.

        Zeroed, not empty: batched decode reads whole blocks and masks the unused tail, and
        masking cannot cancel a NaN that uninitialised memory may hold.
        """
        # storage dim i holds logical dim order[i]; `permute(inverse)` restores the indexing.
        order, inverse = (
            ((2, 0, 1, 3), (1, 2, 0, 3)) if device.type == "cpu" else ((0, 1, 2, 3),) * 2
        )
        stored = torch.zeros([shape[i] for i in order], dtype=dtype, device=device)
        return stored.permute(inverse)


def unreserved_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose untouched pages are not charged against the
    machine's memory commit (an anonymous MAP_NORESERVE mapping), where Linux allows it.

    The CPU swap space is gigabytes that stay untouched until preemption swaps into them.
    Mapped as plain `torch.empty` memory, those gigabytes count in full whenever the process
    forks: Linux's default overcommit heuristic refuses a fork whose private mappings exceed
    RAM + swap, so an engine with a large --swap-space (or a few engines alive in one
    process) left it unable to start a subprocess through fork (Ray's worker start-up is
    one). Pages written later are backed as they are touched, like any other memory.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not MAP_NORESERVE:
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | MAP_NORESERVE)
    # The tensor holds a reference to the mapping, which is unmapped with the last view.
    return torch.frombuffer(mapping, dtype=dtype).view(shape)
