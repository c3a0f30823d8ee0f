"""The KV cache tensors: one (key, value) pair per attention layer on the device, and the
same in CPU memory as the swap space that preemption by swapping moves blocks into."""

from __future__ import annotations

import torch


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    element_size = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


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
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_cpu_blocks = num_cpu_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self._allocate(shape, dtype, device), self._allocate(shape, dtype, device))
            for _ in range(num_layers)
        ]
        # Uninitialised: a swapped-in block is always one that was swapped out. Pinned on
        # CUDA so the copies are asynchronous DMA; on CPU, untouched pages cost nothing.
        cpu_shape = (num_cpu_blocks, block_size, num_kv_heads, head_dim)
        pin = device.type == "cuda"
        self.swap_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.empty(cpu_shape, dtype=dtype, pin_memory=pin),
                torch.empty(cpu_shape, dtype=dtype, pin_memory=pin),
            )
            for _ in range(num_layers if num_cpu_blocks else 0)
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
