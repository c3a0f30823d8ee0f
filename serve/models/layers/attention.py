"""Paged attention as a layer: write this step's K/V into the cache, attend over the context."""

from __future__ import annotations

import torch
from torch import nn

from serve import kernels
from serve.models.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        # Bound once by the model runner: ([num_blocks, block_size, num_kv_heads, head_dim],) * 2
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim]
        if self.kv_cache is None:
            raise RuntimeError("Attention layer has no KV cache bound.")
        meta = get_forward_context()
        key_cache, value_cache = self.kv_cache
        kernels.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = kernels.paged_attention(q, key_cache, value_cache, meta, self.scale)
        return out.flatten(1)
