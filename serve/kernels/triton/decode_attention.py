"""Paged decode attention: one query token per sequence against its K/V scattered in blocks.

One program per (sequence, KV head, context split). The program loads the query heads that
share its KV head as the rows of one tile (GQA: each K/V block is read once per group, not
once per query head) and walks its share of the context in tiles of `BLOCK_N` tokens, each
token's block looked up in the block table. Online softmax in float32, base 2.

Flash-decoding: when (sequences x KV heads) is too small a grid to fill the GPU, the context
is cut into `num_splits` ranges handled by separate programs, each writing a partial output
normalised by its own softmax sum plus that sum's log; a second kernel merges the splits.

With a sliding window the splits share only the keys the query sees: the context from the
window's first tile on; the tiles before it are never read (`attention_options.py` has the
options' semantics). A head's attention sink joins its softmax once: at the end of the one
split's loop, or in the merge, as one more log-sum with nothing to add to the output.

Tile shapes:

| tensor    | tile                  | padding                                            |
|-----------|-----------------------|----------------------------------------------------|
| q         | [BLOCK_G, BLOCK_D]    | BLOCK_G = next_pow2(group) >= 16 (tl.dot's minimum) |
| k, v      | [BLOCK_N, BLOCK_D]    | BLOCK_D = next_pow2(head_dim): 80 and 96 pad to 128 |
| scores    | [BLOCK_G, BLOCK_N]    | masked past the split's end with -inf              |
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serve.kernels.triton.attention_options import KERNEL_LOG2E, AttentionOptions, soft_cap
from serve.kernels.triton.runtime import check_cache_pair, dot_operands, num_sms

LOG2E = 1.4426950408889634
# Flash-decoding heuristic: split until about this many programs per SM run, each split
# at least MIN_TOKENS_PER_SPLIT tokens long, never more than MAX_SPLITS. To be tuned on a GPU
# with benchmarks/kernels.py.
PROGRAMS_PER_SM = 4
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 16


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many programs share one sequence's context; a power of two (few compiled variants)."""
    num_programs = num_seqs * num_kv_heads
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(num_programs, 1))
    splits = min(wanted, max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    if splits <= 1:
        return 1
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int64
    seq_lens_ptr,  # [num_seqs] int64
    out_ptr,  # [num_seqs, num_heads, head_dim], written when NUM_SPLITS == 1
    partial_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, head_dim] float32, otherwise
    partial_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32, log2 of the split's sum
    alibi_slopes_ptr,  # [num_heads] float32, read if HAS_ALIBI
    sliding_window,  # read if HAS_WINDOW
    softcap_log2,  # logit soft-cap * log2(e), read if HAS_SOFTCAP
    sinks_ptr,  # [num_heads] float32, read if HAS_SINKS and NUM_SPLITS == 1 (else the merge's)
    qk_scale,  # softmax scale * log2(e)
    stride_q_seq,
    stride_q_head,
    stride_q_dim,
    stride_c_block,
    stride_c_offset,
    stride_c_head,
    stride_c_dim,
    stride_table_seq,
    stride_o_seq,
    stride_o_head,
    stride_o_dim,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - 1
    kv_start = 0  # the splits share the keys [kv_start, seq_len)
    if HAS_WINDOW:
        window_start = q_pos - sliding_window + 1  # the first key seen; may be negative
        kv_start = (tl.maximum(window_start, 0) // BLOCK_N) * BLOCK_N  # its tile
    # Splits are whole tiles, so a sequence's splits tile its keys without overlap; the first
    # key of a split that has any is seen (with a window, the first split holds window_start).
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = kv_start + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g  # query head kv_head * GROUP + j reads this KV head
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr
        + seq * stride_q_seq
        + heads[:, None] * stride_q_head
        + offs_d[None, :] * stride_q_dim,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [BLOCK_G, BLOCK_D]
    if HAS_ALIBI:
        slopes = tl.load(alibi_slopes_ptr + heads, mask=g_mask, other=0.0) * KERNEL_LOG2E

    table_ptr = block_tables_ptr + seq * stride_table_seq
    head_offset = kv_head * stride_c_head + offs_d[None, :] * stride_c_dim  # [1, BLOCK_D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if HAS_WINDOW:
            n_mask = n_mask & (offs_n >= window_start)  # nor are keys before the window read
        block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)  # int64
        token_offset = block_ids * stride_c_block + (offs_n % BLOCK_SIZE) * stride_c_offset
        kv_offset = token_offset[:, None] + head_offset  # [BLOCK_N, BLOCK_D]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offset, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if HAS_SOFTCAP:
            scores = soft_cap(scores, softcap_log2)
        if HAS_ALIBI:
            distance = (offs_n - q_pos).to(tl.float32)  # [BLOCK_N], <= 0
            scores += slopes[:, None] * distance[None, :]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)  # 0 on the first tile, where m_i = -inf
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offset, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        pv = tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if HAS_SINKS:
        if NUM_SPLITS == 1:  # the sink: one more score, with a zero value vector
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0) * KERNEL_LOG2E
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.exp2(sink - m_new)
            acc = acc * alpha[:, None]
            m_i = m_new
    has_keys = l_i > 0  # false only for an empty split (or a zero-length sequence)
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out_offset = seq * stride_o_seq + heads[:, None] * stride_o_head
        tl.store(out_ptr + out_offset + offs_d[None, :] * stride_o_dim, acc, mask=out_mask)
    else:
        row = (seq * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, head_dim] float32
    partial_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32
    out_ptr,  # [num_seqs, num_heads, head_dim]
    sinks_ptr,  # [num_heads] float32, read if HAS_SINKS
    stride_o_seq,
    stride_o_head,
    stride_o_dim,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """out = sum_s w_s * partial_s, w_s = 2^lse_s / sum_t 2^lse_t: the softmax over the whole
    context, from each split's softmax over its own part. A sink t adds 2^(t log2e) to the
    denominator and nothing to the sum."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(partial_lse_ptr + row * NUM_SPLITS + offs_s)  # [NUM_SPLITS], -inf if empty
    lse_max = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * KERNEL_LOG2E
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    denominator = tl.sum(weights, 0)
    if HAS_SINKS:
        denominator += tl.exp2(sink - lse_max)
    weights = weights / tl.maximum(denominator, 1e-30)
    partial = tl.load(
        partial_out_ptr + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
        mask=d_mask[None, :],
        other=0.0,
    )  # [NUM_SPLITS, BLOCK_D]
    out = tl.sum(partial * weights[:, None], 0)
    out_offset = seq * stride_o_seq + head * stride_o_head + offs_d * stride_o_dim
    tl.store(out_ptr + out_offset, out, mask=d_mask)


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: each sequence's one new token
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    seq_lens: torch.Tensor,  # [num_seqs] int64, context length including the new token
    max_seq_len: int,  # max(seq_lens), known on the host
    scale: float,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    num_splits: int | None = None,  # None: choose_num_splits
    *,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float32
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
) -> torch.Tensor:
    """Attention of each sequence's single query over its cached context `[0, seq_len)`.

    Precondition: the new token's K/V are already in the cache.
    """
    options = AttentionOptions.checked(query, alibi_slopes, sliding_window, logit_softcap, sinks)
    num_seqs, num_heads, head_dim = query.shape
    check_cache_pair(key_cache, value_cache)
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit a cache of {num_kv_heads} KV heads x {cache_head_dim}."
        )
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    if num_splits is None:
        # With a window no query reads more than `sliding_window` keys: split those.
        max_keys = min(max_seq_len, sliding_window or max_seq_len)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_keys, num_sms(query.device))
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}.")
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    dot_dtype, dot_precision = dot_operands(query.dtype)
    if num_splits > 1:
        partial_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
    else:
        partial_out = partial_lse = out  # placeholders: one split writes `out` directly
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_lse,
        *options.kernel_args(placeholder=query),
        scale * LOG2E,
        *query.stride(),
        *key_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=64 if block_d <= 128 else 32,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        **options.kernel_flags(),
        num_warps=4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            partial_out,
            partial_lse,
            out,
            out if sinks is None else sinks,  # a placeholder where there are none
            *out.stride(),
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_D=block_d,
            HAS_SINKS=sinks is not None,
            num_warps=4,
        )
    return out
