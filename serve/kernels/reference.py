"""Pure-torch kernels: what runs on CPU, and the oracle the Triton kernels are tested against.

KV cache, one pair per layer, indexed `[num_blocks, block_size, num_kv_heads, head_dim]`.
These functions accept any strides. The CPU cache engine allocates the memory head-major
(`[num_kv_heads, num_blocks, block_size, head_dim]` underneath), so that a gather of a
sequence's blocks is already each head's `[context, head_dim]` matrix, ready for a matmul.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serve.kernels.cache_dtypes import as_bytes, narrowed
from serve.kernels.metadata import AttentionMetadata
from serve.kernels.packed_weight import PackedWeight, codes_as_float, group_of_inputs


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = skip this token
) -> None:
    """Store each new token's K/V at its flat slot (`block_id * block_size + offset`), in
    the cache's dtype (cache_dtypes.py: rounded, fp8 saturated)."""
    flat_k = key_cache.flatten(0, 1)  # [num_slots, num_kv_heads, head_dim], a view
    flat_v = value_cache.flatten(0, 1)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    as_bytes(flat_k).index_copy_(0, slot_mapping, as_bytes(narrowed(key, flat_k.dtype)))
    as_bytes(flat_v).index_copy_(0, slot_mapping, as_bytes(narrowed(value, flat_v.dtype)))


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, [num_blocks, block_size, H, D]
    src: torch.Tensor,  # [num_copies] int64 block ids
    dst: torch.Tensor,  # [num_copies] int64 block ids, all distinct
) -> None:
    """Copy-on-write: in every layer, block `dst[i]` becomes a copy of block `src[i]`."""
    for key_cache, value_cache in kv_caches:
        caches = (key_cache,) if value_cache is key_cache else (key_cache, value_cache)
        for cache in map(as_bytes, caches):
            cache.index_copy_(0, dst, cache.index_select(0, src))


def swap_blocks(
    src_cache: torch.Tensor,  # [num_blocks, block_size, H, D], one layer's K or V
    dst_cache: torch.Tensor,  # the same shape on another device (or the same one)
    src_ids: torch.Tensor,  # [n] int64 on src_cache's device
    dst_ids: torch.Tensor,  # [n] int64 on dst_cache's device
) -> None:
    """Move blocks between the device cache and the CPU swap space: `dst[dst_ids[i]] = src[src_ids[i]]`.

    Gathers the blocks into one contiguous buffer first, so crossing devices is one copy.
    """
    # Asynchronous only towards a GPU: a copy to the CPU must land before index_copy_ reads it.
    to_gpu = dst_cache.device.type == "cuda"
    if src_cache.dtype == dst_cache.dtype:  # as they are (fp8 blocks as bytes)
        src_cache, dst_cache = as_bytes(src_cache), as_bytes(dst_cache)
    staged = src_cache.index_select(0, src_ids).to(dst_cache.device, non_blocking=to_gpu)
    dst_cache.index_copy_(0, dst_ids, staged.to(dst_cache.dtype))


# Bytes of one prefill tile's [heads, tile, context] score matrix: a tile holds as many
# queries as fit, so a long context's temporaries stay under glibc's mmap threshold and
# are reused from the heap step after step (serve/worker/cpu_malloc.py).
_SCORES_BYTES = 16 << 20
# Decodes run in groups of this many, sorted by length, so padding to the group's longest
# context wastes little while the whole group is one batched matmul.
_DECODE_GROUP = 16


def _heads_first(cache: torch.Tensor) -> torch.Tensor:
    return cache.permute(2, 0, 1, 3)  # [num_kv_heads, num_blocks, block_size, head_dim]


def _gather(cache_h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The blocks `table` of a heads-first cache: [num_kv_heads, len(table) * block_size, D]."""
    blocks = cache_h.index_select(1, table)  # [num_kv_heads, len(table), block_size, D]
    return blocks.view(blocks.shape[0], -1, blocks.shape[3])


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float32
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole cached context.

    Precondition: this step's K/V are already in the cache (`reshape_and_cache`).
    Handles decode, prefill and chunked prefill over a cached prefix in one call.

    The score of query position i for key position j, in this order:
    `s = scale * q.k`; with `logit_softcap` c, `s = c * tanh(s / c)`; with `alibi_slopes`,
    `s += slope[head] * (j - i)`; with `sliding_window` w, keys with `i - j >= w` are
    masked (the query sees itself and the w - 1 keys before it, as transformers masks).
    With `sinks` (GPT-OSS), head h's sink logit joins the softmax's denominator as one more
    score whose value vector is zero: `out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) +
    e^(sink_h - m))`, `m` the largest of the scores and the sink.
    """
    options = _Options(alibi_slopes, sliding_window, logit_softcap, sinks)
    out = torch.empty_like(query)
    k_cache, v_cache = _heads_first(key_cache), _heads_first(value_cache)
    num_decodes = meta.num_decode_seqs
    lens = meta.seq_lens_cpu
    order = sorted(range(num_decodes), key=lens.__getitem__)
    for i in range(0, num_decodes, _DECODE_GROUP):
        group = order[i : i + _DECODE_GROUP]
        rows = torch.tensor(group, device=query.device)
        out[rows] = _decode_group(query[rows], k_cache, v_cache, meta, group, rows, scale, options)
    attend_chunks(
        out,
        query,
        key_cache,
        value_cache,
        meta,
        range(num_decodes, meta.num_seqs),
        scale,
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        sinks=sinks,
    )
    return out


def attend_chunks(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written at these sequences' rows
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    seqs: Iterable[int],  # indices of sequences in the batch
    scale: float,
    *,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """`paged_attention` for the given sequences one at a time, as prompts and chunks run:
    each one's context gathered once, then attended by torch's fused attention in tiles of
    queries."""
    options = _Options(alibi_slopes, sliding_window, logit_softcap, sinks)
    k_cache, v_cache = _heads_first(key_cache), _heads_first(value_cache)
    lens = meta.seq_lens_cpu
    starts = [0, *itertools.accumulate(meta.query_lens_cpu)]
    block_size = key_cache.shape[1]
    for b in seqs:
        seq_len, q_len, start = lens[b], meta.query_lens_cpu[b], starts[b]
        # With a window, blocks before the first query's window are never read.
        first_key = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1)
        first_block = first_key // block_size
        table = meta.block_tables[b, first_block : -(-seq_len // block_size)]
        key_start = first_block * block_size  # position of the first gathered key
        k = _gather(k_cache, table)[:, : seq_len - key_start].to(query.dtype)  # [kv_heads, L, D]
        v = _gather(v_cache, table)[:, : seq_len - key_start].to(query.dtype)
        query_tile = max(1, _SCORES_BYTES // (query.shape[1] * seq_len * query.element_size()))
        for tile in range(0, q_len, query_tile):
            tile_len = min(query_tile, q_len - tile)
            context = seq_len - q_len + tile + tile_len  # keys visible to the tile's last query
            rows = slice(start + tile, start + tile + tile_len)
            out[rows] = _attend_causal(
                query[rows],
                k[:, : context - key_start],
                v[:, : context - key_start],
                scale,
                key_start,
                options,
            )


@dataclass(frozen=True)
class _Options:
    alibi_slopes: torch.Tensor | None
    sliding_window: int | None
    logit_softcap: float | None
    sinks: torch.Tensor | None

    def apply(
        self,
        scores: torch.Tensor,  # [num_kv_heads, n, heads_per_kv, q_len, num_keys], scaled
        q_pos: torch.Tensor,  # [n, q_len] int64
        k_pos: torch.Tensor,  # [num_keys] or [n, num_keys] int64
    ) -> torch.Tensor:
        """Soft-cap, ALiBi and the window on a score tensor (causality is the caller's)."""
        if self.logit_softcap is not None:
            scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
        k_pos = k_pos.view(-1, 1, k_pos.shape[-1])  # [n or 1, 1, num_keys]
        distance = k_pos - q_pos[:, :, None]  # [n, q_len, num_keys], <= 0 if seen
        if self.alibi_slopes is not None:
            num_kv_heads, heads_per_kv = scores.shape[0], scores.shape[2]
            slopes = self.alibi_slopes.to(scores.dtype).view(num_kv_heads, 1, heads_per_kv, 1, 1)
            scores = scores + slopes * distance[None, :, None].to(scores.dtype)
        if self.sliding_window is not None:
            outside = distance <= -self.sliding_window  # [n, q_len, num_keys]
            scores = scores.masked_fill(outside[None, :, None], -torch.inf)
        return scores

    def softmax(
        self,
        scores: torch.Tensor,  # [num_kv_heads, n, heads_per_kv, q_len, num_keys], masked
    ) -> torch.Tensor:  # the same shape
        """The probabilities over the keys; with sinks, each head's sink is one more score
        in the denominator, with no value (every row sees at least one key)."""
        if self.sinks is None:
            return scores.softmax(dim=-1)
        num_kv_heads, _, heads_per_kv = scores.shape[:3]
        sinks = self.sinks.to(scores.dtype).view(num_kv_heads, 1, heads_per_kv, 1, 1)
        top = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)
        weights = (scores - top).exp()
        return weights / (weights.sum(dim=-1, keepdim=True) + (sinks - top).exp())

    @property
    def needs_scores(self) -> bool:
        """A soft-cap bends each score and a sink joins the softmax: neither fits torch's
        fused attention, so the scores are materialised."""
        return self.logit_softcap is not None or self.sinks is not None

    @property
    def is_plain(self) -> bool:
        return self.alibi_slopes is None and self.sliding_window is None and not self.needs_scores


def _decode_group(
    q: torch.Tensor,  # [g, num_heads, head_dim]: one query per sequence
    k_cache: torch.Tensor,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    group: list[int],  # the sequences' indices in the batch
    rows: torch.Tensor,  # the same indices, on the device
    scale: float,
    options: _Options,
) -> torch.Tensor:  # [g, num_heads, head_dim]
    g, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[0], k_cache.shape[2]
    heads_per_kv = num_heads // num_kv_heads  # query head h * heads_per_kv + j reads kv head h
    seq_lens = [meta.seq_lens_cpu[b] for b in group]
    # Each sequence's blocks from the first its window reaches (block 0 without a window),
    # as many as the group's widest needs; entries past a sequence's end are masked.
    window = options.sliding_window
    first_blocks = [0 if window is None else max(0, n - window) // block_size for n in seq_lens]
    num_blocks = max(-(-n // block_size) - f for n, f in zip(seq_lens, first_blocks))
    if window is None:
        table = meta.block_tables[rows, :num_blocks]  # [g, num_blocks]; padding reads block 0
        k_pos = torch.arange(num_blocks * block_size, device=q.device)  # [L], every sequence
    else:
        first = torch.tensor(first_blocks, device=q.device)  # [g]
        cols = first[:, None] + torch.arange(num_blocks, device=q.device)  # [g, num_blocks]
        table = meta.block_tables[rows[:, None], cols.clamp(max=meta.block_tables.shape[1] - 1)]
        k_pos = first[:, None] * block_size + torch.arange(num_blocks * block_size, device=q.device)
    table = table.flatten()
    k = _gather(k_cache, table).to(q.dtype)  # [num_kv_heads, g * L, head_dim]
    v = _gather(v_cache, table).to(q.dtype)
    lens = meta.seq_lens[rows]
    past_end = k_pos.view(-1, k_pos.shape[-1]) >= lens[:, None]  # [g or 1 -> g, L]
    if not options.needs_scores:
        # torch's fused attention: one query per sequence, its keys masked to the context.
        k_pos = k_pos.view(-1, k_pos.shape[-1])  # [g or 1, L]
        visible = ~past_end
        distance = k_pos - (lens - 1)[:, None]  # [g, L], <= 0 if seen
        if window is not None:
            visible &= distance > -window
        mask = visible[:, None, None, :]  # [g, 1, 1, L]
        if options.alibi_slopes is not None:  # [g, num_heads, 1, L] additive bias
            slopes = options.alibi_slopes.to(q.dtype)[None, :, None, None]
            mask = (slopes * distance[:, None, None, :].to(q.dtype)).masked_fill(~mask, -torch.inf)
        out = F.scaled_dot_product_attention(
            q[:, :, None],  # [g, num_heads, 1, head_dim]
            k.view(num_kv_heads, g, -1, head_dim).transpose(0, 1),  # [g, kv_heads, L, D]
            v.view(num_kv_heads, g, -1, head_dim).transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return out[:, :, 0]  # [g, num_heads, head_dim]
    k = k.view(num_kv_heads * g, -1, head_dim)  # [H*g, L, D]
    v = v.view(num_kv_heads * g, -1, head_dim)
    qg = q.view(g, num_kv_heads, heads_per_kv, head_dim).transpose(0, 1)
    qg = qg.reshape(num_kv_heads * g, heads_per_kv, head_dim)
    scores = torch.bmm(qg, k.transpose(1, 2)) * scale  # [H*g, heads_per_kv, L]
    scores5 = scores.view(num_kv_heads, g, heads_per_kv, 1, -1)
    scores5 = options.apply(scores5, (lens - 1)[:, None], k_pos)
    scores5 = scores5.masked_fill(past_end[None, :, None, None], -torch.inf)
    out = torch.bmm(options.softmax(scores5).view_as(scores), v)  # [H*g, heads_per_kv, D]
    return (
        out.view(num_kv_heads, g, heads_per_kv, head_dim)
        .transpose(0, 1)
        .reshape(g, num_heads, head_dim)
    )


def _attend_causal(
    q: torch.Tensor,  # [q_len, num_heads, head_dim], the last q_len positions of the context
    k: torch.Tensor,  # [num_kv_heads, num_keys, head_dim]: positions [key_start, context)
    v: torch.Tensor,
    scale: float,
    key_start: int,
    options: _Options,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    q_len, num_heads, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[0], k.shape[1]
    context = key_start + num_keys
    if not options.needs_scores:
        return _attend_sdpa(q, k, v, scale, key_start, options)
    heads_per_kv = num_heads // num_kv_heads
    # Query heads that share a KV head are stacked, so GQA is one matmul per KV head.
    qg = q.view(q_len, num_kv_heads, heads_per_kv, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, heads_per_kv * q_len, head_dim)
    scores = torch.matmul(qg, k.transpose(1, 2)) * scale  # [kv_heads, heads_per_kv * q_len, keys]
    q_pos = torch.arange(context - q_len, context, device=q.device)  # [q_len]
    k_pos = torch.arange(key_start, context, device=q.device)  # [num_keys]
    scores5 = scores.view(num_kv_heads, 1, heads_per_kv, q_len, num_keys)
    scores = options.apply(scores5, q_pos[None, :], k_pos).view_as(scores)
    if q_len > 1:
        future = k_pos[None, :] > q_pos[:, None]  # [q_len, num_keys]
        scores.view(num_kv_heads, heads_per_kv, q_len, num_keys).masked_fill_(future, -torch.inf)
    probs = options.softmax(scores.view_as(scores5)).view_as(scores)
    out = torch.matmul(probs, v)  # [kv_heads, heads_per_kv * q_len, head_dim]
    return out.view(num_kv_heads, heads_per_kv, q_len, head_dim).permute(2, 0, 1, 3).flatten(1, 2)


def _attend_sdpa(
    q: torch.Tensor,  # [q_len, num_heads, head_dim], the last q_len positions of the context
    k: torch.Tensor,  # [num_kv_heads, num_keys, head_dim]: positions [key_start, context)
    v: torch.Tensor,
    scale: float,
    key_start: int,
    options: _Options,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    """`_attend_causal` through torch's fused attention (its flash kernel on CPU), which
    never materialises the scores: ~3x faster on prompts. Causality, the window and ALiBi go
    in as a mask; a soft-cap or sinks cannot, so those models take the explicit path."""
    q_len, num_keys = q.shape[0], k.shape[1]
    context = key_start + num_keys
    mask, is_causal = None, False
    if options.is_plain and q_len == num_keys:
        is_causal = True  # the whole context is this chunk: the square causal mask
    elif q_len > 1 or not options.is_plain:
        q_pos = torch.arange(context - q_len, context, device=q.device)  # [q_len]
        k_pos = torch.arange(key_start, context, device=q.device)  # [num_keys]
        distance = k_pos[None, :] - q_pos[:, None]  # [q_len, num_keys], <= 0 if seen
        visible = distance <= 0
        if options.sliding_window is not None:
            visible &= distance > -options.sliding_window
        mask = visible
        if options.alibi_slopes is not None:  # [num_heads, q_len, num_keys] additive bias
            bias = options.alibi_slopes.to(q.dtype)[:, None, None] * distance.to(q.dtype)
            mask = bias.masked_fill(~visible, -torch.inf)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, num_heads, q_len, head_dim]
        k[None],
        v[None],
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)  # [q_len, num_heads, head_dim]


# The reference looks for a row's nucleus among its most likely tokens first: picking them
# (topk) costs a small part of sorting the whole vocabulary, which took 110 ms at 64 rows
# of a 49k vocabulary and 720 ms of a 262k one on two CPU cores. The default model's
# nucleus at top_p 0.95 and temperature 1 held at most 43 tokens over 300 sampled steps of
# chat; a row whose nucleus is wider (a flat distribution) is sorted whole.
TOP_P_CANDIDATES = 256


def top_p_cut(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:  # -> [rows, 1]
    """Each row's top-p edge: the least likely logit of its nucleus, the fewest most likely
    tokens whose probability reaches its top_p (0 < top_p <= 1); the tokens at least as
    likely as the edge are the nucleus, ties at the edge included."""
    vocab = logits.shape[1]
    cut, complete = nucleus_edge(logits, top_p, min(TOP_P_CANDIDATES, vocab))
    if not bool(complete.all()):
        wider = (~complete).nonzero().flatten()
        cut[wider] = nucleus_edge(logits[wider], top_p[wider], vocab)[0]
    return cut


def nucleus_edge(
    logits: torch.Tensor, top_p: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's edge [rows, 1], looked for among its `count` most likely tokens, and
    whether the nucleus ends among them [rows]."""
    if count < logits.shape[1]:
        values = logits.topk(count, dim=-1).values  # most likely first
    else:
        values = logits.sort(dim=-1, descending=True).values
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly more likely tokens
    kept = (mass_before < top_p[:, None]).sum(dim=-1).clamp_(min=1)  # a prefix of each row
    complete = (kept < count) | (count == logits.shape[1])
    return values.gather(1, (kept - 1)[:, None]), complete


def argmax(x: torch.Tensor) -> torch.Tensor:  # [rows, n] -> [rows] int64
    """Each row's largest value's index: the first where several tie; a NaN counts as larger
    than any number (torch.argmax's rules, which greedy decoding's exactness rests on)."""
    return x.argmax(dim=-1)


def linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, out_features]
    return F.linear(x, weight, bias)


def dequantize(weight: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as `dtype` [out, in]: `(code - zero) * scale` in float32, then rounded
    (packed_weight.py's contract), its inputs in the checkpoint's order (stored input i
    back at column `input_perm[i]` where they were sorted by group)."""
    groups = group_of_inputs(weight)  # [in]
    values = codes_as_float(weight)  # [out, in], stored order
    if weight.zeros is not None:
        values = values - weight.zeros[:, groups]
    values = values * weight.scales[:, groups]
    if weight.input_perm is not None:
        values = torch.empty_like(values).index_copy_(1, weight.input_perm, values)
    return values.to(dtype)


def quantized_linear(
    x: torch.Tensor,  # [num_tokens, in_features], the checkpoint's input order
    weight: PackedWeight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, out_features]
    """x @ w.T + bias with w dequantized whole for this call (the weight stays packed
    between calls: that is the memory a quantized checkpoint saves), in x's input order:
    no gather of x, so it checks the kernels' (`x[:, input_perm]` against stored w)."""
    return F.linear(x, dequantize(weight, x.dtype), bias)


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
    out = F.silu(gate)
    return out.mul_(up)  # in place on the fresh tensor: one pass fewer than `silu(gate) * up`


def moe_experts(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: each expert's gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int, distinct experts per token
) -> torch.Tensor:  # [num_tokens, hidden]
    """A mixture of SwiGLU experts: each token's sum over its top-k experts e of
    `topk_weight * w2[e] @ (silu(gate_e x) * up_e x)`.

    Only the routed experts compute: the (token, expert) pairs are grouped by expert, each
    expert with tokens runs its MLP once on exactly them, and the weighted rows are added
    back to their tokens, expert by expert in increasing order (as transformers does). The
    product with the routing weights promotes as in transformers (float32 weights make a
    float32 product) and is rounded to the hidden dtype where it is added.
    """

    def mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        return linear(silu_and_mul(linear(rows, w13[expert])), w2[expert])

    return routed_experts(hidden, topk_weights, topk_ids, w13.shape[0], mlp)


def routed_experts(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int, distinct experts per token
    num_experts: int,
    mlp: Callable[[int, torch.Tensor], torch.Tensor],  # (expert, its rows) -> [rows, hidden]
) -> torch.Tensor:  # [num_tokens, hidden]
    """`moe_experts`' order of operations with each expert's MLP as `mlp` (a quantized
    checkpoint's experts are packed linears, not stacked float weights)."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(hidden)
    if num_tokens == 0:
        return out
    flat_ids = topk_ids.flatten()  # [num_tokens * top_k]: pair p is token p // top_k
    order = flat_ids.argsort(stable=True)  # the pairs, grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    tokens = order // top_k
    weights = topk_weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        down = mlp(expert, hidden[rows])  # [count, hidden]
        weighted = down * weights[start : start + count, None]
        out.index_add_(0, rows, weighted.to(out.dtype))
        start += count
    return out
