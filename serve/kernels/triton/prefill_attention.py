"""Paged prefill / extend attention: causal attention for variable-length query chunks.

Sequence b's chunk is `query[query_start_loc[b] : query_start_loc[b + 1]]`, the last
`q_len` positions of a context of `seq_len` tokens whose K/V are all in the paged cache
(an earlier prefix from prefix-cache hits or earlier chunks, then this chunk's own tokens,
written by `reshape_and_cache` just before). Every key is read through the block table, so
a cached prefix and the chunk itself are one loop.

One program per (query head, tile of BLOCK_M queries, sequence); it walks keys in tiles of
BLOCK_N with an online softmax, never holding more than a [BLOCK_M, BLOCK_N] score tile.
For query rows at positions [p0, p1] (p1 = min(p0 + BLOCK_M, seq_len) - 1), the keys split
in two, or with a sliding window w in four:

| keys                                            | visible to            | mask                    |
|-------------------------------------------------|-----------------------|-------------------------|
| [0, w0): w0 = p0 - w + 1 rounded down to a tile | no row: never read    | -                       |
| [w0, f0): f0 = p1 - w + 1 rounded up, <= a0     | some rows             | window                  |
| [f0, a0): a0 = p0 rounded down to a tile        | every row of the tile | none                    |
| [a0, p1] (diagonal)                             | some rows             | causal, seq_len, window |

Without a window w0 = f0 = 0. With one, a row can meet a masked tile that holds none of its
keys before one that does; the online softmax leaves the row as it was (m stays -inf), and
every row ends having seen at least itself. ALiBi and the soft-cap change scores, not which
keys are read (`attention_options.py`); a head's attention sink joins each row's softmax
after its last key tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from serve.kernels.triton.attention_options import KERNEL_LOG2E, AttentionOptions, soft_cap
from serve.kernels.triton.runtime import check_cache_pair, dot_operands

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int  # query rows per program
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int


def choose_prefill_tiles(head_dim: int, dtype: torch.dtype) -> PrefillTiles:
    """Starting points after the flash-attention tutorial's H100 configs, not yet tuned (see
    benchmarks/kernels.py). Wider heads and float32 take smaller tiles: q and the output
    accumulator, [block_m, head_dim] each, live in registers."""
    if dtype == torch.float32:
        return PrefillTiles(
            block_m=32 if head_dim > 128 else 64, block_n=32, num_warps=4, num_stages=2
        )
    if head_dim > 128:
        return PrefillTiles(block_m=64, block_n=32, num_warps=8, num_stages=2)
    if head_dim <= 64:
        return PrefillTiles(block_m=128, block_n=64, num_warps=4, num_stages=3)
    return PrefillTiles(block_m=128, block_n=64, num_warps=8, num_stages=3)


@triton.jit
def _attend_tile(
    acc,  # [BLOCK_M, BLOCK_D] float32, unnormalised output
    l_i,  # [BLOCK_M] float32, softmax denominators
    m_i,  # [BLOCK_M] float32, running max of the base-2 scores
    q,  # [BLOCK_M, BLOCK_D] DOT_DTYPE
    q_pos,  # [BLOCK_M] absolute positions of the query rows
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,  # this sequence's block table row
    head_offset,  # [1, BLOCK_D]: this KV head's offset within a cache slot
    tile_start,
    seq_len,
    qk_scale,
    slope,  # this head's ALiBi slope * log2(e), if HAS_ALIBI
    sliding_window,
    softcap_log2,
    stride_c_block,
    stride_c_offset,
    d_mask,  # [BLOCK_D]
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_DIAGONAL: tl.constexpr,  # masks keys past seq_len and past each row's position
    IS_WINDOW_EDGE: tl.constexpr,  # masks keys before each row's window
    HAS_ALIBI: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_n = tile_start + tl.arange(0, BLOCK_N)
    if IS_DIAGONAL:
        n_mask = offs_n < seq_len
        block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
    else:
        block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE)
    token_offset = block_ids * stride_c_block + (offs_n % BLOCK_SIZE) * stride_c_offset
    kv_offset = token_offset[:, None] + head_offset  # [BLOCK_N, BLOCK_D]
    if IS_DIAGONAL:
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        kv_mask = d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offset, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if HAS_SOFTCAP:
        scores = soft_cap(scores, softcap_log2)
    if HAS_ALIBI:
        scores += slope * (offs_n[None, :] - q_pos[:, None]).to(tl.float32)
    if IS_DIAGONAL:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (q_pos[:, None] - offs_n[None, :] < sliding_window)
        scores = tl.where(visible, scores, float("-inf"))  # [BLOCK_M, BLOCK_N]
    if IS_WINDOW_EDGE:
        in_window = q_pos[:, None] - offs_n[None, :] < sliding_window
        scores = tl.where(in_window, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_ref = m_new
    if HAS_WINDOW:
        # A row whose window starts past every key so far has seen none: m_new = -inf. It
        # subtracts 0 instead (p = 0, alpha = 0) and keeps m = -inf for its first seen key.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_offset, mask=kv_mask, other=0.0).to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [num_tokens, num_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int64
    seq_lens_ptr,  # [num_seqs] int64
    query_start_loc_ptr,  # [num_seqs + 1] int64
    first_seq,  # the batch index of program_id(2) == 0 (decodes come first)
    alibi_slopes_ptr,  # [num_heads] float32, read if HAS_ALIBI
    sliding_window,  # read if HAS_WINDOW
    softcap_log2,  # logit soft-cap * log2(e), read if HAS_SOFTCAP
    sinks_ptr,  # [num_heads] float32, read if HAS_SINKS
    qk_scale,  # softmax scale * log2(e)
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_c_block,
    stride_c_offset,
    stride_c_head,
    stride_c_dim,
    stride_table_seq,
    stride_o_token,
    stride_o_head,
    stride_o_dim,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    head = tl.program_id(0)
    tile_m = tl.program_id(1)
    seq = first_seq + tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile_m * BLOCK_M >= q_len:
        return  # the grid covers the longest chunk; this one is shorter
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + tile_m * BLOCK_M  # position of the tile's first query

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = seq_len - q_len + offs_m
    q_offset = (q_start + offs_m[:, None]) * stride_q_token + head * stride_q_head
    q = tl.load(
        q_ptr + q_offset + offs_d[None, :] * stride_q_dim,
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]

    table_ptr = block_tables_ptr + seq * stride_table_seq
    head_offset = (head // GROUP) * stride_c_head + offs_d[None, :] * stride_c_dim
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(alibi_slopes_ptr + head) * KERNEL_LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    full_start = 0  # the first key tile every row sees whole
    if HAS_WINDOW:
        # Keys before the first row's window are skipped; the tiles up to the last row's
        # window start (rounded up) are seen only in part, and masked.
        window_tile = (tl.maximum(first_pos - sliding_window + 1, 0) // BLOCK_N) * BLOCK_N
        last_pos = tl.minimum(seq_len, first_pos + BLOCK_M) - 1
        last_window_start = tl.maximum(last_pos - sliding_window + 1, 0)
        full_start = tl.minimum(tl.cdiv(last_window_start, BLOCK_N) * BLOCK_N, full_end)
        for tile_start in range(window_tile, full_start, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, head_offset,
                tile_start, seq_len, qk_scale, slope, sliding_window, softcap_log2,
                stride_c_block, stride_c_offset, d_mask, BLOCK_SIZE, BLOCK_N, False, True,
                HAS_ALIBI, HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_PRECISION,
            )  # fmt: skip
    for tile_start in range(full_start, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, head_offset,
            tile_start, seq_len, qk_scale, slope, sliding_window, softcap_log2,
            stride_c_block, stride_c_offset, d_mask, BLOCK_SIZE, BLOCK_N, False, False,
            HAS_ALIBI, HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip
    diagonal_end = tl.minimum(seq_len, first_pos + BLOCK_M)
    for tile_start in range(full_end, diagonal_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, head_offset,
            tile_start, seq_len, qk_scale, slope, sliding_window, softcap_log2,
            stride_c_block, stride_c_offset, d_mask, BLOCK_SIZE, BLOCK_N, True, False,
            HAS_ALIBI, HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip

    if HAS_SINKS:  # the head's sink: one more score, with a zero value vector
        sink = tl.load(sinks_ptr + head) * KERNEL_LOG2E
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    # Every real row sees its own key, so l_i > 0; rows past the chunk are not stored.
    acc = acc / tl.where(m_mask, l_i, 1.0)[:, None]
    out_offset = (q_start + offs_m[:, None]) * stride_o_token + head * stride_o_head
    tl.store(
        out_ptr + out_offset + offs_d[None, :] * stride_o_dim,
        acc,
        mask=m_mask[:, None] & d_mask[None, :],
    )


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], the whole batch
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    seq_lens: torch.Tensor,  # [num_seqs] int64
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int64
    first_seq: int,  # sequences [first_seq, num_seqs) are computed
    max_query_len: int,  # over those sequences, known on the host
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; only those sequences' rows are written
    tiles: PrefillTiles | None = None,
    *,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float32
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
) -> torch.Tensor:
    """Causal attention of sequences `[first_seq, num_seqs)`'s query chunks over their contexts.

    Precondition: the chunks' own K/V are already in the cache.
    """
    options = AttentionOptions.checked(query, alibi_slopes, sliding_window, logit_softcap, sinks)
    num_seqs = seq_lens.shape[0] - first_seq
    _, num_heads, head_dim = query.shape
    check_cache_pair(key_cache, value_cache)
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit a cache of {num_kv_heads} KV heads x {cache_head_dim}."
        )
    if num_seqs <= 0 or max_query_len == 0:
        return out
    if tiles is None:
        tiles = choose_prefill_tiles(head_dim, query.dtype)
    dot_dtype, dot_precision = dot_operands(query.dtype)
    grid = (num_heads, triton.cdiv(max_query_len, tiles.block_m), num_seqs)
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        first_seq,
        *options.kernel_args(placeholder=query),
        scale * LOG2E,
        *query.stride(),
        *key_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        **options.kernel_flags(),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
