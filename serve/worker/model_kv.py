"""A model's paged KV cache on this rank: its shape, read off the model's attention layers,
and a cache of that shape handed to those layers. The target model and a draft model
(draft_model.py) each have one, addressed by the same block ids."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve.kernels.cache_dtypes import KV_CACHE_TORCH_DTYPES, cache_fits
from serve.kv_cache.cache_engine import CacheEngine, kv_bytes_per_block
from serve.models.layers.attention import attention_layers
from serve.models.loader import dtype_name


@dataclass(frozen=True)
class ModelKV:
    num_layers: int
    num_kv_heads: int  # this rank's
    head_dim: int
    dtype: torch.dtype
    shared_kv: bool = False  # the keys are the values: one tensor a layer (attention.py)

    @classmethod
    def of(cls, model: torch.nn.Module, kv_cache_dtype: str = "auto") -> ModelKV:
        """The cache `model`'s attention layers need, stored in `kv_cache_dtype`
        (--kv-cache-dtype; auto: the model's dtype)."""
        attn = attention_layers(model)
        weight = next(model.parameters())
        dtype = cache_dtype(weight.dtype, kv_cache_dtype)
        if dtype == torch.float8_e4m3fn and weight.device.type == "cuda":
            # Triton's e4m3 (fp8e4nv) is the hardware's: Ada and Hopper have it, Ampere not.
            capability = torch.cuda.get_device_capability(weight.device)
            if capability < (8, 9):
                raise ValueError(
                    f"--kv-cache-dtype {kv_cache_dtype} (fp8 e4m3) needs a GPU of compute "
                    "capability 8.9 or newer (Ada, Hopper); this one is "
                    f"{capability[0]}.{capability[1]}: use fp8_e5m2 or bfloat16."
                )
        shared_kv = {layer.shared_kv for layer in attn}
        if len(shared_kv) > 1:
            raise ValueError("a model's attention layers either all share K/V tensors or none do")
        return cls(len(attn), attn[0].num_kv_heads, attn[0].head_dim, dtype, shared_kv.pop())

    def bytes_per_block(self, block_size: int) -> int:
        return kv_bytes_per_block(
            self.num_layers,
            block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.shared_kv,
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
            self.shared_kv,
        )
        for layer, kv_cache in zip(attention_layers(model), cache.kv_caches):
            layer.kv_cache = kv_cache
        return cache


def cache_dtype(model_dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The KV cache's dtype: the model's, or a narrower one (cache_dtypes.py's rules).
    Attention widens the rows it reads back to the model's dtype (or float32); a cache as
    wide as the model in another format (float16 under bfloat16) or wider would only round
    twice, and is refused."""
    if kv_cache_dtype == "auto":
        return model_dtype
    dtype = KV_CACHE_TORCH_DTYPES[kv_cache_dtype]
    if not cache_fits(model_dtype, dtype):
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype} is no narrower than the model's {dtype_name(model_dtype)}: "
            "leave it at auto to store K/V in the model's dtype, add --dtype float32, or "
            "choose fp8."
        )
    return dtype
