"""Rotary position embedding, applied in place to q and k.

Each token's program rotates all its query and key heads by the angles of its position.
Pairs of channels rotate together; which channels pair up depends on the style:

| style | pair i (0 <= i < rotary_dim / 2)  |
|-------|-----------------------------------|
| neox  | (i, i + rotary_dim / 2)           |
| gpt-j | (2i, 2i + 1)                      |

Channels from rotary_dim to head_dim are left as they are. The rotation is computed in
float32 and rounded once, where the reference rounds after each torch op in q's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,  # this token's [num_heads, head_dim]
    stride_head,
    stride_dim,
    cos,  # [1, BLOCK_PAIRS] float32
    sin,
    NUM_HEADS: tl.constexpr,
    NUM_PAIRS: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_i = tl.arange(0, BLOCK_PAIRS)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_i < NUM_PAIRS)
    if IS_NEOX:
        first, second = offs_i, offs_i + NUM_PAIRS
    else:
        first, second = 2 * offs_i, 2 * offs_i + 1
    ptr1 = x_ptr + offs_h * stride_head + first * stride_dim
    ptr2 = x_ptr + offs_h * stride_head + second * stride_dim
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, x1 * cos - x2 * sin, mask=mask)
    tl.store(ptr2, x2 * cos + x1 * sin, mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache_ptr,  # [max_position, rotary_dim]: cos half, then sin half
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_k_token,
    stride_k_head,
    stride_k_dim,
    stride_cache_position,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    NUM_PAIRS: tl.constexpr,  # rotary_dim / 2
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    offs_i = tl.arange(0, BLOCK_PAIRS)[None, :]
    cache_row = cos_sin_cache_ptr + position * stride_cache_position
    pair_mask = offs_i < NUM_PAIRS
    cos = tl.load(cache_row + offs_i, mask=pair_mask, other=1.0).to(tl.float32)
    sin = tl.load(cache_row + NUM_PAIRS + offs_i, mask=pair_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        query_ptr + token * stride_q_token, stride_q_head, stride_q_dim, cos, sin,
        NUM_HEADS, NUM_PAIRS, IS_NEOX, BLOCK_H, BLOCK_PAIRS,
    )  # fmt: skip
    _rotate_heads(
        key_ptr + token * stride_k_token, stride_k_head, stride_k_dim, cos, sin,
        NUM_KV_HEADS, NUM_PAIRS, IS_NEOX, BLOCK_KV_H, BLOCK_PAIRS,
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], any strides
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], any strides
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos half, then sin half
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first `rotary_dim` channels of q and k by their positions, in place;
    returns (query, key), the same tensors."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rotary_dim = cos_sin_cache.shape[-1]
    if key.shape[0] != num_tokens or key.shape[2] != head_dim or positions.shape != (num_tokens,):
        raise ValueError(
            f"positions {tuple(positions.shape)}, query {tuple(query.shape)} and key "
            f"{tuple(key.shape)} disagree."
        )
    if rotary_dim % 2 or rotary_dim > head_dim or cos_sin_cache.stride(-1) != 1:
        raise ValueError(
            f"cos_sin_cache {tuple(cos_sin_cache.shape)} does not fit head_dim {head_dim}."
        )
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions,
            query,
            key,
            cos_sin_cache,
            *query.stride(),
            *key.stride(),
            cos_sin_cache.stride(0),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            NUM_PAIRS=rotary_dim // 2,
            IS_NEOX=is_neox_style,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_PAIRS=triton.next_power_of_2(rotary_dim // 2),
            num_warps=4,
        )
    return query, key
