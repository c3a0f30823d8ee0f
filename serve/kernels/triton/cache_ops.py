"""KV-cache writes and block moves: reshape_and_cache, copy_blocks, swap_blocks.

A cache is indexed `[num_blocks, block_size, num_kv_heads, head_dim]` with any strides (the
CPU cache engine stores it heads-first); kernels take the strides, never assume them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serve.kernels.cache_dtypes import as_bytes, fp8_max
from serve.kernels.triton.runtime import can_launch, check_cache_pair


@triton.jit
def _saturate(x, limit: tl.constexpr):
    """x clipped to [-limit, limit]; comparisons leave NaN as it is."""
    return tl.where(x > limit, limit, tl.where(x < -limit, -limit, x))


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    stride_k_token,
    stride_k_head,
    stride_k_dim,
    stride_v_token,
    stride_v_head,
    stride_v_dim,
    stride_c_block,
    stride_c_offset,
    stride_c_head,
    stride_c_dim,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SATURATE_AT: tl.constexpr,  # an fp8 cache's largest finite value; 0: no saturation
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    cache_offset = (
        (slot // BLOCK_SIZE) * stride_c_block
        + (slot % BLOCK_SIZE) * stride_c_offset
        + offs_h * stride_c_head
        + offs_d * stride_c_dim
    )
    key_offset = token * stride_k_token + offs_h * stride_k_head + offs_d * stride_k_dim
    value_offset = token * stride_v_token + offs_h * stride_v_head + offs_d * stride_v_dim
    key = tl.load(key_ptr + key_offset, mask=mask)
    value = tl.load(value_ptr + value_offset, mask=mask)
    if SATURATE_AT > 0:
        key = _saturate(key.to(tl.float32), SATURATE_AT)
        value = _saturate(value.to(tl.float32), SATURATE_AT)
    tl.store(key_cache_ptr + cache_offset, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offset, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = skip this token
) -> None:
    """Store each new token's K/V at its flat slot (`block_id * block_size + offset`), cast to
    the cache's dtype."""
    check_cache_pair(key_cache, value_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit a cache of "
            f"{tuple(key_cache.shape)}."
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [{num_tokens}].")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        SATURATE_AT=fp8_max(key_cache.dtype),
        num_warps=4,
    )


@triton.jit
def _copy_block_rows_kernel(
    src_ptr,  # [num_src_blocks, block_size, num_kv_heads, head_dim]
    dst_ptr,  # [num_dst_blocks, block_size, num_kv_heads, head_dim]
    src_ids_ptr,  # [num_copies] int64
    dst_ids_ptr,  # [num_copies] int64
    stride_s_block,
    stride_s_offset,
    stride_s_head,
    stride_s_dim,
    stride_d_block,
    stride_d_offset,
    stride_d_head,
    stride_d_dim,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dst[dst_ids[i], offset] = src[src_ids[i], offset]: one token slot per program."""
    copy = tl.program_id(0)
    offset = tl.program_id(1)
    src_block = tl.load(src_ids_ptr + copy)
    dst_block = tl.load(dst_ids_ptr + copy)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    src = src_ptr + src_block * stride_s_block + offset * stride_s_offset
    dst = dst_ptr + dst_block * stride_d_block + offset * stride_d_offset
    rows = tl.load(src + offs_h * stride_s_head + offs_d * stride_s_dim, mask=mask)
    tl.store(dst + offs_h * stride_d_head + offs_d * stride_d_dim, rows, mask=mask)


def copy_block_rows(
    src: torch.Tensor,  # [num_src_blocks, block_size, num_kv_heads, head_dim]
    dst: torch.Tensor,  # [num_dst_blocks, block_size, num_kv_heads, head_dim], src's dtype
    src_ids: torch.Tensor,  # [num_copies] int64, on the device
    dst_ids: torch.Tensor,  # [num_copies] int64, on the device
) -> None:
    """`dst[dst_ids[i]] = src[src_ids[i]]`, block by block. Programs run in any order, so a
    block written here must not also be read here (CoW targets are freshly allocated)."""
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype or src.device != dst.device:
        raise ValueError(
            f"cannot copy blocks of {tuple(src.shape)} {src.dtype} on {src.device} into "
            f"{tuple(dst.shape)} {dst.dtype} on {dst.device}."
        )
    num_copies = src_ids.shape[0]
    if num_copies == 0:
        return
    src, dst = as_bytes(src), as_bytes(dst)  # fp8 rows move as bytes
    _, block_size, num_kv_heads, head_dim = src.shape
    _copy_block_rows_kernel[(num_copies, block_size)](
        src,
        dst,
        src_ids,
        dst_ids,
        *src.stride(),
        *dst.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, [num_blocks, block_size, H, D]
    src: torch.Tensor,  # [num_copies] int64 block ids
    dst: torch.Tensor,  # [num_copies] int64 block ids, all distinct, none of them in src
) -> None:
    """Copy-on-write: in every layer, block `dst[i]` becomes a copy of block `src[i]`."""
    for key_cache, value_cache in kv_caches:
        copy_block_rows(key_cache, key_cache, src, dst)
        if value_cache is not key_cache:  # one tensor where the keys are the values
            copy_block_rows(value_cache, value_cache, src, dst)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """`cache[block_ids]` as one contiguous `[n, block_size, H, D]` buffer on cache's device."""
    staged = torch.empty(
        (block_ids.shape[0], *cache.shape[1:]), dtype=cache.dtype, device=cache.device
    )
    arange = torch.arange(block_ids.shape[0], device=cache.device)
    copy_block_rows(cache, staged, block_ids, arange)
    return staged


def scatter_blocks(staged: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """`cache[block_ids[i]] = staged[i]`, the inverse of gather_blocks."""
    arange = torch.arange(block_ids.shape[0], device=cache.device)
    copy_block_rows(staged, cache, arange, block_ids)


def swap_blocks(
    src_cache: torch.Tensor,  # [num_blocks, block_size, H, D], one layer's K or V
    dst_cache: torch.Tensor,  # the same shape on another device (or the same one)
    src_ids: torch.Tensor,  # [n] int64 on src_cache's device
    dst_ids: torch.Tensor,  # [n] int64 on dst_cache's device
) -> None:
    """Move blocks between the device cache and the CPU swap space: `dst[dst_ids[i]] = src[src_ids[i]]`.

    The blocks are gathered into one contiguous buffer beside the source, crossed over in a
    single copy, and scattered beside the destination; a side Triton cannot run on (the
    CPU, outside the interpreter) uses torch indexing.
    """
    if src_cache.shape[1:] != dst_cache.shape[1:]:
        raise ValueError(
            f"cannot swap {tuple(src_cache.shape)} blocks into {tuple(dst_cache.shape)}."
        )
    if src_ids.shape[0] == 0:
        return
    if can_launch(src_cache):
        staged = gather_blocks(src_cache, src_ids)
    else:
        staged = as_bytes(src_cache).index_select(0, src_ids).view(src_cache.dtype)
    # Asynchronous only towards a GPU: a device-to-host copy with non_blocking may still be in
    # flight when the CPU reads the buffer below.
    staged = staged.to(dst_cache.device, dst_cache.dtype, non_blocking=dst_cache.is_cuda)
    if can_launch(dst_cache):
        scatter_blocks(staged, dst_cache, dst_ids)
    else:
        as_bytes(dst_cache).index_copy_(0, dst_ids, as_bytes(staged))
