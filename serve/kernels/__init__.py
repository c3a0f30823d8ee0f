"""The kernel interface the model layers call.

Each op runs the Triton kernel when its tensors are on CUDA and the pure-torch reference
otherwise (`backend.py` decides, and `SERVE_KERNEL_BACKEND` overrides it). The signatures
and contracts are the reference's; see `reference.py` for each op's documentation.
`linear` is torch's on CUDA (cuBLAS); on CPU, `serve.kernels.cpu` picks MKL's fastest form.
"""

from __future__ import annotations

import torch

from serve.kernels.backend import ops_for
from serve.kernels.metadata import AttentionMetadata
from serve.kernels.packed_weight import PackedWeight

__all__ = [
    "AttentionMetadata",
    "argmax",
    "copy_blocks",
    "linear",
    "moe_experts",
    "paged_attention",
    "quantized_linear",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "swap_blocks",
    "top_p_cut",
]


def argmax(x: torch.Tensor) -> torch.Tensor:  # [rows, n] -> [rows] int64
    """Greedy sampling's pick: each row's largest value's index, by torch.argmax's rules."""
    return ops_for(x.device).argmax(x)


def top_p_cut(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:  # -> [rows, 1]
    """Each row's top-p edge: the least likely logit of its nucleus (reference.py)."""
    return ops_for(logits.device).top_p_cut(logits, top_p)


def linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, out_features]
    return ops_for(x.device).linear(x, weight, bias)


def quantized_linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: PackedWeight,  # a quantized checkpoint's weight, packed_weight.py's layout
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, out_features]
    return ops_for(x.device).quantized_linear(x, weight, bias)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = skip this token
) -> None:
    ops = ops_for(key_cache.device)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float32, this rank's heads
    sliding_window: int | None = None,  # keys at distance >= this are masked
    logit_softcap: float | None = None,  # scores become c * tanh(scores / c)
    sinks: torch.Tensor | None = None,  # [num_heads] float32: a valueless logit per head
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    return ops_for(query.device).paged_attention(
        query,
        key_cache,
        value_cache,
        meta,
        scale,
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        sinks=sinks,
    )


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, [num_blocks, block_size, H, D]
    src: torch.Tensor,  # [num_copies] int64 block ids
    dst: torch.Tensor,  # [num_copies] int64 block ids, all distinct, none of them in src
) -> None:
    if kv_caches:
        ops_for(kv_caches[0][0].device).copy_blocks(kv_caches, src, dst)


def swap_blocks(
    src_cache: torch.Tensor,  # [num_blocks, block_size, H, D], one layer's K or V
    dst_cache: torch.Tensor,  # the same shape on another device (or the same one)
    src_ids: torch.Tensor,  # [n] int64 on src_cache's device
    dst_ids: torch.Tensor,  # [n] int64 on dst_cache's device
) -> None:
    # Whichever side is on the GPU decides: swapping in reads CPU memory but writes the GPU.
    device = src_cache.device if src_cache.device.type == "cuda" else dst_cache.device
    ops_for(device).swap_blocks(src_cache, dst_cache, src_ids, dst_ids)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return ops_for(x.device).rms_norm(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos half, then sin half
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated (query, key). The Triton kernel rotates the given tensors in place and
    returns them; the reference returns new tensors. Callers use the returned pair."""
    ops = ops_for(query.device)
    return ops.rotary_embedding(positions, query, key, cos_sin_cache, is_neox_style)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2d] -> [T, d]
    return ops_for(x.device).silu_and_mul(x)


def moe_experts(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int, distinct experts per token
) -> torch.Tensor:  # [num_tokens, hidden]
    """Each token's routed SwiGLU experts, weighted and summed; only routed experts compute."""
    return ops_for(hidden.device).moe_experts(hidden, w13, w2, topk_weights, topk_ids)
