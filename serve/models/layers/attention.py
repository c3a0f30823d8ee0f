"""Paged attention as a layer: write this step's K/V into the cache, attend over the context.

The options the model families need ride on the layer and go to the kernel with every
call: ALiBi slopes (BLOOM, MPT, Falcon RW, Baichuan 13B), a sliding window (Mistral, Gemma's
local layers), a logit soft-cap (Gemma 2), attention sinks (GPT-OSS: a learned logit per
head that joins the softmax with no value; a checkpoint weight, so a parameter holding this
rank's heads) and a free scale (Gemma's `query_pre_attn_scalar`, Granite's multiplier).

With `shared_kv` the keys are also the values (DeepSeek's multi-head latent attention: each
token's compressed latent and its rotated key part, attended as one KV head whose output's
latent channels the caller keeps): the layer's cache is one tensor, bound as both K and V.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from serve import kernels
from serve.distributed.parallel_state import get_tp_group
from serve.models.forward_context import get_forward_context
from serve.models.layers.linear import check_checkpoint_shape
from serve.models.lazy_tensor import LazyTensor, as_lazy


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        *,
        alibi_slopes: torch.Tensor | None = None,  # [num_heads] float32, this rank's heads
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: bool = False,
        shared_kv: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        if alibi_slopes is not None and alibi_slopes.shape != (num_heads,):
            raise ValueError(f"alibi_slopes {tuple(alibi_slopes.shape)}: expected ({num_heads},)")
        self.register_buffer(
            "alibi_slopes",
            None if alibi_slopes is None else alibi_slopes.float(),
            persistent=False,
        )
        self.sliding_window = sliding_window or None
        self.logit_softcap = logit_softcap or None
        # [num_heads] float32: this rank's heads [rank * num_heads, (rank + 1) * num_heads)
        # of the checkpoint's [total_num_heads] sink logits.
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(
                torch.empty(num_heads, dtype=torch.float32), requires_grad=False
            )
            self.sinks.weight_loader = self._load_sinks
        self.shared_kv = shared_kv
        # Bound once by the model runner: ([num_blocks, block_size, num_kv_heads, head_dim],) * 2,
        # the same tensor twice where `shared_kv`.
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def _load_sinks(
        self, param: nn.Parameter, loaded: LazyTensor | torch.Tensor, shard_name: str | None = None
    ) -> None:
        if shard_name is not None:
            raise ValueError(f"attention sinks have no shard {shard_name!r}")
        tp = get_tp_group()
        loaded = as_lazy(loaded)
        check_checkpoint_shape(loaded, (self.num_heads * tp.world_size,), "sinks")
        param.data.copy_(loaded.narrow(0, tp.rank * self.num_heads, self.num_heads))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim]
        # (v None where `shared_kv`: the keys are the values). `sinks` [num_heads]: sink
        # logits held by the caller rather than the layer (the transformers backend passes
        # the HF module's own parameter), for a layer built without them.
        if self.kv_cache is None:
            raise RuntimeError("Attention layer has no KV cache bound.")
        if (v is None) != self.shared_kv:
            raise ValueError("values are given exactly when the layer's K/V are not shared")
        if sinks is None:
            sinks = self.sinks
        elif self.sinks is not None:
            raise ValueError("the layer holds its own attention sinks")
        elif sinks.dtype != torch.float32:
            sinks = sinks.float()
        meta = get_forward_context()
        key_cache, value_cache = self.kv_cache
        if v is None:
            v = k
        kernels.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = kernels.paged_attention(
            q,
            key_cache,
            value_cache,
            meta,
            self.scale,
            alibi_slopes=self.alibi_slopes,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
            sinks=sinks,
        )
        return out.flatten(1)


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's attention layers in order: one KV cache pair is bound to each."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def alibi_slopes(total_num_heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al.) as BLOOM computes them, [total_num_heads] float32:
    powers of 2^(-8 / n) for the n = largest power of two <= heads, and for the heads beyond
    n, the odd powers of the series for 2n. Computed in float32 as transformers does, so the
    biases match it bit for bit."""
    closest = 2 ** math.floor(math.log2(total_num_heads))
    base = torch.tensor(2.0 ** (-8.0 / closest), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest < total_num_heads:
        extra_base = torch.tensor(2.0 ** (-8.0 / (2 * closest)), dtype=torch.float32)
        num_extra = total_num_heads - closest
        odd_powers = torch.arange(1, 1 + 2 * num_extra, 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, odd_powers)])
    return slopes
