"""The KV cache tensors: one (key, value) pair per attention layer."""

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
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: attention reads whole blocks and masks the unwritten tail,
        # and masking cannot cancel a NaN that uninitialised memory may hold.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]
