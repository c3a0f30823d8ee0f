"""Pure-torch kernels: what runs on CPU, and the oracle the Triton kernels are tested against.

KV cache layout, one pair per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from serve.kernels.metadata import AttentionMetadata


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = skip this token
) -> None:
    """Store each new token's K/V at its flat slot (`block_id * block_size + offset`)."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    max_len: int,
) -> torch.Tensor:  # [num_seqs, num_kv_heads, max_len, head_dim]
    block_size = cache.shape[1]
    num_blocks = -(-max_len // block_size)
    blocks = cache[block_tables[:, :num_blocks]]  # [num_seqs, num_blocks, block_size, H, D]
    ctx = blocks.flatten(1, 2)[:, :max_len]  # [num_seqs, max_len, H, D]
    return ctx.transpose(1, 2)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole cached context.

    Precondition: this step's K/V are already in the cache (`reshape_and_cache`).
    Handles prefill, chunked prefill over a cached prefix, and decode in one call.
    """
    out = torch.empty_like(query)
    nd = meta.num_decode_seqs
    if nd:
        max_len = max(meta.seq_lens_cpu[:nd])
        k = _gather_context(key_cache, meta.block_tables[:nd], max_len)
        v = _gather_context(value_cache, meta.block_tables[:nd], max_len)
        positions = torch.arange(max_len, device=query.device)
        mask = positions[None, :] < meta.seq_lens[:nd, None]  # [nd, max_len]
        q = query[:nd].unsqueeze(2)  # [nd, num_heads, 1, head_dim]
        attn = F.scaled_dot_product_attention(
            q,
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        out[:nd] = attn.squeeze(2)

    start = nd
    for b in range(nd, meta.num_seqs):
        seq_len, q_len = meta.seq_lens_cpu[b], meta.query_lens_cpu[b]
        q = query[start : start + q_len].transpose(0, 1)  # [num_heads, q_len, head_dim]
        k = _gather_context(key_cache, meta.block_tables[b : b + 1], seq_len)[0]
        v = _gather_context(value_cache, meta.block_tables[b : b + 1], seq_len)[0]
        if q_len == seq_len:
            mask = None
        else:
            # Query i sits at absolute position seq_len - q_len + i and sees keys <= it.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        attn = F.scaled_dot_product_attention(
            q,
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + q_len] = attn.transpose(0, 1)
        start += q_len
    return out


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in float32; with `residual`, adds it first and also returns the sum."""
    if residual is not None:
        x = x + residual
        residual = x
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return out if residual is None else (out, residual)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos half, then sin half
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first `rotary_dim` channels of q and k by their positions.

    neox style rotates pairs (i, i + d/2); gpt-j style rotates interleaved pairs (2i, 2i+1).
    """
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        if is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        return torch.cat((rotated, rest), dim=-1) if rest.numel() else rotated

    return rotate(query), rotate(key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2d] -> [T, d]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
