"""A model's paged KV cache on this rank: its shape, read off the model's attention layers,
and a cache of that shape handed to those layers. The target model and a draft model
(draft_model.py) each have one, addressed by the same block ids."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve.kv_cache.cache_engine import CacheEngine, kv_bytes_per_block
from serve.models.layers.attention import attention_layers


@dataclass(frozen=True)
class ModelKV:
    num_layers: int
    num_kv_heads: int  # this rank's
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: torch.nn.Module, kv_cache_dtype: str = "auto") -> ModelKV:
        """The cache `model`'s attention layers need, stored in `kv_cache_dtype`
        (--kv-cache-dtype; auto: the model's dtype)."""
        attn = attention_layers(model)
        model_dtype = next(model.parameters()).dtype
        dtype = cache_dtype(model_dtype, kv_cache_dtype)
        return cls(len(attn), attn[0].num_kv_heads, attn[0].head_dim, dtype)

    def bytes_per_block(self, block_size: int) -> int:
        return kv_bytes_per_block(
            self.num_layers, block_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    def attach_cache(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        num_cpu_blocks: int = 0,
    ) -> CacheEngine:
        """A cache of `num_blocks` blocks (and a swap space), given to `model`'s layers."""
        cache = CacheEngine(
            self.num_layers,
            num_blocks,
            block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            device,
            num_cpu_blocks,
        )
        for layer, kv_cache in zip(attention_layers(model), cache.kv_caches):
            layer.kv_cache = kv_cache
        return cache


def cache_dtype(model_dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The KV cache's dtype: the model's, or a 16-bit one under a float32 model. Attention
    widens the rows it reads back to the model's float32; a cache wider than the model, or
    one 16-bit format under the other, would only round twice, and is refused."""
    if kv_cache_dtype == "auto":
        return model_dtype
    dtype = getattr(torch, kv_cache_dtype)
    if dtype != model_dtype and model_dtype != torch.float32:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype} needs a float32 model, and this one runs in "
            f"{str(model_dtype).removeprefix('torch.')}: leave it at auto to store K/V in "
            "the model's dtype, or add --dtype float32."
        )
    return dtype
