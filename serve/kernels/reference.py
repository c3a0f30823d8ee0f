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


# Queries per tile in prefill, bounding the [heads, tile, context] score matrix.
_QUERY_TILE = 1024


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] for one sequence
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    table = block_table[: -(-seq_len // block_size)]
    # index_select over whole-block rows is a plain row copy, the cheapest gather on CPU.
    rows = cache.view(num_blocks, -1).index_select(0, table)
    return rows.view(-1, cache.shape[2], cache.shape[3])[:seq_len]


def _attend(
    q: torch.Tensor,  # [q_len, num_heads, head_dim], at positions [seq_len - q_len, seq_len)
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    q_len, num_heads, head_dim = q.shape
    seq_len, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads  # query head h * group + g reads kv head h
    # Grouping the query heads that share a KV head turns GQA into one matmul per KV head.
    qg = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * q_len, head_dim)
    scores = torch.matmul(qg, k.permute(1, 2, 0)) * scale  # [kv_heads, group * q_len, seq_len]
    if q_len > 1:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        future = torch.arange(seq_len, device=q.device)[None, :] > q_pos[:, None]
        scores.view(num_kv_heads, group, q_len, seq_len).masked_fill_(future, float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.transpose(0, 1))  # [kv_heads, group * q_len, head_dim]
    return out.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).flatten(1, 2)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole cached context.

    Precondition: this step's K/V are already in the cache (`reshape_and_cache`).
    Handles prefill, chunked prefill over a cached prefix, and decode in one call. On CPU a
    loop over sequences with an exact-length gather beats one padded batched gather: it
    copies only real context, and the copy, not the arithmetic, is the cost.
    """
    out = torch.empty_like(query)
    start = 0
    for b, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        k = _gather_context(key_cache, meta.block_tables[b], seq_len).to(query.dtype)
        v = _gather_context(value_cache, meta.block_tables[b], seq_len).to(query.dtype)
        for tile in range(0, q_len, _QUERY_TILE):
            tile_len = min(_QUERY_TILE, q_len - tile)
            context = seq_len - q_len + tile + tile_len  # keys visible to the tile's last query
            q = query[start + tile : start + tile + tile_len]
            out[start + tile : start + tile + tile_len] = _attend(
                q, k[:context], v[:context], scale
            )
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
