"""A mixture of SwiGLU experts as two grouped GEMMs over the routed (token, expert) pairs.

Pair p = t * top_k + j is token t's j-th expert. The pairs are grouped by expert, each
expert's group padded to a multiple of BLOCK_M, so every block of BLOCK_M rows belongs to
one expert (`align_by_expert`):

| sorted_pairs   | 5 1 7 _ | 0 2 _ _ | 3 4 6 _ |      (_ = padding, the value num_pairs)
| block_experts  |    0    |    2    |    3    | 4 4  (expert 1 has no pairs; 4 = past the end)

1. gate/up: one program per (block, tile of BLOCK_N intermediate columns) multiplies its
   rows' tokens by its expert's gate and up tiles and stores silu(gate) * up at the pair's
   row of `act` [num_pairs, inter].
2. down: one program per (block, tile of BLOCK_N hidden columns) multiplies its rows of
   `act` by its expert's down tile, scales by the pair's routing weight and stores at the
   pair's row of `partial` [num_tokens, top_k, hidden]; a sum over top_k ends it.

Each program loads only its expert's weight tiles; no product touches an expert without
tokens. Padding rows are masked on load and store. Blocks past the last expert's group
(the grid is sized for the worst case, so nothing waits on the host) return at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from serve.kernels.triton.runtime import dot_operands


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # routed rows per program, one expert's
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


def choose_moe_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeTiles:
    """Starting points, not tuned: BLOCK_M follows the pairs an expert gets on average, so
    a decode step (a few pairs per expert) pads little and a prefill fills its tiles."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if dtype == torch.float32:
        return MoeTiles(block_m=16 if per_expert <= 16 else 32, block_n=64, block_k=32,
                        num_warps=4, num_stages=2)  # fmt: skip
    if per_expert <= 16:
        return MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return MoeTiles(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)
    if per_expert <= 256:
        return MoeTiles(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
    return MoeTiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


# Pairs per program of the two alignment kernels; each walks its pairs CHUNK at a time.
_PAIRS_PER_PROGRAM = 256


@triton.jit
def _count_kernel(
    topk_ids_ptr,  # [num_pairs]
    counts_ptr,  # [num_programs, EXPERTS] int32, written: each program's pairs per expert
    num_pairs,
    PAIRS_PER_PROGRAM: tl.constexpr,
    EXPERTS: tl.constexpr,  # num_experts rounded up to a power of two
    CHUNK: tl.constexpr,
):
    program = tl.program_id(0)
    experts = tl.arange(0, EXPERTS)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for offset in range(0, PAIRS_PER_PROGRAM, CHUNK):
        pairs = program * PAIRS_PER_PROGRAM + offset + lanes
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + program * EXPERTS + experts, counts)


@triton.jit
def _place_kernel(
    topk_ids_ptr,  # [num_pairs]
    counts_ptr,  # [num_programs, EXPERTS] int32, from _count_kernel
    sorted_pairs_ptr,  # [max_rows] int32: padding already written; real rows written here
    block_experts_ptr,  # [num_blocks] int32, written
    num_pairs,
    num_experts,
    num_programs,
    num_blocks,
    blocks_per_program,
    BLOCK_M: tl.constexpr,
    PAIRS_PER_PROGRAM: tl.constexpr,
    EXPERTS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Lays out the experts' padded row ranges from all programs' counts, writes its share
    of the blocks' experts, and places its pairs, stable within an expert."""
    program = tl.program_id(0)
    experts = tl.arange(0, EXPERTS)
    lanes = tl.arange(0, CHUNK)
    totals = tl.zeros((EXPERTS,), dtype=tl.int32)
    earlier = tl.zeros((EXPERTS,), dtype=tl.int32)  # pairs per expert in earlier programs
    for first in range(0, num_programs, CHUNK):
        programs = first + lanes
        counts = tl.load(
            counts_ptr + programs[:, None] * EXPERTS + experts[None, :],
            mask=programs[:, None] < num_programs,
            other=0,
        )  # [CHUNK, EXPERTS]
        totals += tl.sum(counts, axis=0)
        earlier += tl.sum(tl.where(programs[:, None] < program, counts, 0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # one past each expert's last row
    starts = ends - padded
    # A block's expert: the number of experts that end at or before its first row
    # (num_experts past the last).
    is_expert = experts < num_experts
    for offset in range(0, blocks_per_program, CHUNK):
        blocks = program * blocks_per_program + offset + lanes
        ended = (ends[None, :] <= blocks[:, None] * BLOCK_M) & is_expert[None, :]
        block_experts = tl.sum(ended.to(tl.int32), axis=1)
        is_mine = (offset + lanes < blocks_per_program) & (blocks < num_blocks)
        tl.store(block_experts_ptr + blocks, block_experts, mask=is_mine)
    # A pair's row: its expert's start, the pairs of that expert before it in earlier
    # programs and earlier chunks (the cursor), and earlier in its chunk (the rank).
    cursors = starts + earlier
    for offset in range(0, PAIRS_PER_PROGRAM, CHUNK):
        pairs = program * PAIRS_PER_PROGRAM + offset + lanes
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        onehot = ids[:, None] == experts[None, :]  # [CHUNK, EXPERTS]
        cursor = tl.sum(tl.where(onehot, cursors[None, :], 0), axis=1)
        before = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
        rank = tl.sum(before.to(tl.int32), axis=1)
        tl.store(sorted_pairs_ptr + cursor + rank, pairs, mask=pairs < num_pairs)
        cursors += tl.sum(onehot.to(tl.int32), axis=0)


def align_by_expert(
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [max_rows] int32, block_experts [max_rows // block_m] int32), the
    table in the module docstring, on the device with no host sync: programs of
    _PAIRS_PER_PROGRAM pairs count their pairs per expert, then each lays out the
    experts' rows from all the counts and places its own pairs.

    `max_rows` bounds the padded length: every expert that has pairs (at most
    min(num_experts, num_pairs) of them) pads by fewer than block_m rows.
    """
    num_pairs = topk_ids.numel()
    max_rows = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    num_blocks = max_rows
    max_rows *= block_m
    device = topk_ids.device
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    block_experts = torch.empty((num_blocks,), dtype=torch.int32, device=device)
    experts_pow2 = triton.next_power_of_2(num_experts)
    chunk = max(16, min(64, 8192 // experts_pow2))  # a [chunk, experts] tile stays small
    num_programs = triton.cdiv(num_pairs, _PAIRS_PER_PROGRAM)
    counts = torch.empty((num_programs, experts_pow2), dtype=torch.int32, device=device)
    ids = topk_ids.contiguous().view(-1)
    sizes = dict(PAIRS_PER_PROGRAM=_PAIRS_PER_PROGRAM, EXPERTS=experts_pow2, CHUNK=chunk)
    _count_kernel[(num_programs,)](ids, counts, num_pairs, **sizes, num_warps=4)
    _place_kernel[(num_programs,)](
        ids,
        counts,
        sorted_pairs,
        block_experts,
        num_pairs,
        num_experts,
        num_programs,
        num_blocks,
        triton.cdiv(num_blocks, num_programs),
        BLOCK_M=block_m,
        **sizes,
        num_warps=4,
    )
    return sorted_pairs, block_experts


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [num_tokens, hidden]
    w13_ptr,  # [num_experts, 2 * inter, hidden]
    act_ptr,  # [num_pairs, inter]: silu(gate) * up per pair
    sorted_pairs_ptr,  # [max_rows] int32
    block_experts_ptr,  # [max_rows // BLOCK_M] int32
    num_pairs,
    num_experts,
    inter,
    hidden,
    stride_x_token,
    stride_x_k,
    stride_w_expert,
    stride_w_n,
    stride_w_k,
    stride_act_pair,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    is_row = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # intermediate columns
    is_col = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_x_token + ks[None, :] * stride_x_k
    # [BLOCK_K, BLOCK_N] tiles of the gate rows and of the up rows `inter` below them.
    gate_ptrs = (
        w13_ptr
        + expert.to(tl.int64) * stride_w_expert
        + cols[None, :].to(tl.int64) * stride_w_n
        + ks[:, None] * stride_w_k
    )
    up_ptrs = gate_ptrs + inter * stride_w_n
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        is_k = ks + k0 < hidden
        x = tl.load(x_ptrs, mask=is_row[:, None] & is_k[None, :], other=0.0).to(DOT_DTYPE)
        w_mask = is_k[:, None] & is_col[None, :]
        w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0).to(DOT_DTYPE)
        w_up = tl.load(up_ptrs, mask=w_mask, other=0.0).to(DOT_DTYPE)
        gate = tl.dot(x, w_gate, gate, input_precision=DOT_PRECISION)
        up = tl.dot(x, w_up, up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_x_k
        gate_ptrs += BLOCK_K * stride_w_k
        up_ptrs += BLOCK_K * stride_w_k
    act = gate / (1.0 + tl.exp(-gate)) * up
    act_ptrs = act_ptr + pairs[:, None].to(tl.int64) * stride_act_pair + cols[None, :]
    tl.store(act_ptrs, act, mask=is_row[:, None] & is_col[None, :])


@triton.jit
def _down_kernel(
    act_ptr,  # [num_pairs, inter]
    w2_ptr,  # [num_experts, hidden, inter]
    weights_ptr,  # [num_pairs]: each pair's routing weight
    out_ptr,  # [num_pairs, hidden]: the weighted down projection per pair
    sorted_pairs_ptr,
    block_experts_ptr,
    num_pairs,
    num_experts,
    hidden,
    inter,
    stride_act_pair,
    stride_w_expert,
    stride_w_n,
    stride_w_k,
    stride_out_pair,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    is_row = pairs < num_pairs
    rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden columns
    is_col = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    act_ptrs = act_ptr + rows[:, None] * stride_act_pair + ks[None, :]
    w_ptrs = (
        w2_ptr
        + expert.to(tl.int64) * stride_w_expert
        + cols[None, :].to(tl.int64) * stride_w_n
        + ks[:, None] * stride_w_k
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        is_k = ks + k0 < inter
        a = tl.load(act_ptrs, mask=is_row[:, None] & is_k[None, :], other=0.0).to(DOT_DTYPE)
        w = tl.load(w_ptrs, mask=is_k[:, None] & is_col[None, :], other=0.0).to(DOT_DTYPE)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        act_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_w_k
    weight = tl.load(weights_ptr + rows, mask=is_row, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + rows[:, None] * stride_out_pair + cols[None, :]
    tl.store(out_ptrs, acc * weight[:, None], mask=is_row[:, None] & is_col[None, :])


def moe_experts(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    *,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:  # [num_tokens, hidden]
    """The reference's contract (reference.moe_experts). float32 inside each GEMM; the
    SiLU-and-mul output and each pair's weighted row are rounded to the hidden dtype, and
    the sum over top_k is torch's (float32 accumulation)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, inter2, w13_hidden = w13.shape
    inter = inter2 // 2
    top_k = topk_ids.shape[1] if topk_ids.dim() == 2 else -1
    if (
        w13_hidden != hidden_size
        or inter2 % 2
        or tuple(w2.shape) != (num_experts, hidden_size, inter)
        or topk_ids.shape != (num_tokens, top_k)
        or topk_weights.shape != topk_ids.shape
    ):
        raise ValueError(
            "moe_experts expects hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights "
            f"and topk_ids [T, k]; got {tuple(hidden.shape)}, {tuple(w13.shape)}, "
            f"{tuple(w2.shape)}, {tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}."
        )
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise TypeError(f"expert weights {w13.dtype}/{w2.dtype} must match hidden {hidden.dtype}.")
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    num_pairs = num_tokens * top_k
    if tiles is None:
        tiles = choose_moe_tiles(num_pairs, num_experts, hidden.dtype)
    dot_dtype, dot_precision = dot_operands(hidden.dtype)
    sorted_pairs, block_experts = align_by_expert(topk_ids, num_experts, tiles.block_m)
    num_blocks = block_experts.shape[0]

    act = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, tiles.block_n))](
        hidden,
        w13,
        act,
        sorted_pairs,
        block_experts,
        num_pairs,
        num_experts,
        inter,
        hidden_size,
        *hidden.stride(),
        *w13.stride(),
        act.stride(0),
        TOP_K=top_k,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    partial = torch.empty(
        (num_tokens, top_k, hidden_size), dtype=hidden.dtype, device=hidden.device
    )
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, tiles.block_n))](
        act,
        w2,
        topk_weights.contiguous().view(-1),
        partial,
        sorted_pairs,
        block_experts,
        num_pairs,
        num_experts,
        hidden_size,
        inter,
        act.stride(0),
        *w2.stride(),
        partial.stride(1),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return partial[:, 0] if top_k == 1 else partial.sum(dim=1)
