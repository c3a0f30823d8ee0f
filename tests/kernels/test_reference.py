"""The pure-torch kernels against naive dense implementations, on fresh random inputs.

Paged caches get shuffled (non-contiguous) block tables and random contents everywhere,
so a kernel that reads the wrong block, or fails to mask a block's tail, gives a wrong
answer instead of a lucky zero.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from serve.kernels import reference
from serve.kernels.metadata import AttentionMetadata
from serve.kernels.reference import (
    paged_attention,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)

ATOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These shapes are tiny: a second intra-op thread only adds spin-waiting, which costs
    100x on a loaded 2-core machine."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# -- paged cache helpers ------------------------------------------------------------------------


@dataclass
class PagedBatch:
    meta: AttentionMetadata
    block_tables: list[list[int]]  # unpadded
    num_blocks: int
    block_size: int


def make_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_decode_seqs: int,
    block_size: int,
    generator: torch.Generator,
    num_spare_blocks: int = 3,
) -> PagedBatch:
    """Each sequence gets its own blocks, taken from a shuffled pool of physical ids."""
    assert all(1 <= q <= s for q, s in zip(query_lens, seq_lens))
    assert all(q == 1 for q in query_lens[:num_decode_seqs])
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + num_spare_blocks
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(pool[start : start + n])
        start += n
    max_blocks = max(needed)
    slots = []
    for table, seq_len, q_len in zip(tables, seq_lens, query_lens):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    query_start_loc = [0]
    for q_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables]),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.long),
        seq_lens_cpu=list(seq_lens),
        query_lens_cpu=list(query_lens),
        num_decode_seqs=num_decode_seqs,
    )
    return PagedBatch(meta, tables, num_blocks, block_size)


def context_slots(table: list[int], block_size: int, positions: range) -> torch.Tensor:
    return torch.tensor(
        [table[p // block_size] * block_size + p % block_size for p in positions], dtype=torch.long
    )


def naive_causal_attention(
    q: torch.Tensor,  # [q_len, num_heads, head_dim], at positions [seq_len - q_len, seq_len)
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    v: torch.Tensor,
    scale: float,
    *,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads]
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    """Dense attention in float64, the options written out as the papers define them (the
    sinks as transformers' GPT-OSS eager attention: a column of the softmax, then dropped)."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # head h reads kv head h // group, as HF repeat_kv
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    if alibi_slopes is not None:
        scores = scores + alibi_slopes.double()[:, None, None] * (k_pos - q_pos)[None]
    visible = k_pos <= q_pos  # [q_len, seq_len]
    if sliding_window is not None:
        visible &= q_pos - k_pos < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink_column = sinks.double()[:, None, None].expand(num_heads, q_len, 1)
        probs = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v.double()).float()


ATTENTION_CASES = {
    # name: ([(seq_len, query_len), ...], num_decode_seqs); block-relative lengths are in
    # units of `bs`, resolved per block size so contexts end mid-block and on block ends.
    "decode": (lambda bs: [(1, 1), (bs, 1), (bs + 1, 1), (2 * bs, 1), (3 * bs - 1, 1), (37, 1)], 6),
    "prefill": (lambda bs: [(1, 1), (5, 5), (2 * bs, 2 * bs), (17, 17)], 0),
    "extend": (lambda bs: [(9, 3), (2 * bs + 3, 2 * bs), (33, 1), (3 * bs, bs), (20, 19)], 0),
    "mixed": (lambda bs: [(7, 1), (2 * bs, 1), (1, 1), (10, 10), (25, 6), (bs + 2, 2)], 3),
    # More decodes than one batched group holds, in no particular length order.
    "many-decodes": (lambda bs: [(1 + (i * 7) % 50, 1) for i in range(37)] + [(12, 4)], 37),
}
HEAD_LAYOUTS = {"mha": (4, 4), "gqa3": (9, 3), "mqa": (8, 1)}


def random_cache(shape: tuple[int, ...], layout: str, gen: torch.Generator) -> torch.Tensor:
    """Random stale data, indexed [block, offset, head, dim]; "heads_first" stores it the way
    the CPU cache engine does (heads outermost), "contiguous" as the shape reads."""
    if layout == "contiguous":
        return torch.randn(shape, generator=gen)
    num_blocks, block_size, num_kv_heads, head_dim = shape
    stored = torch.randn((num_kv_heads, num_blocks, block_size, head_dim), generator=gen)
    return stored.permute(1, 2, 0, 3)


@pytest.mark.parametrize("layout", ["contiguous", "heads_first"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", HEAD_LAYOUTS.values(), ids=HEAD_LAYOUTS.keys())
@pytest.mark.parametrize("case", ATTENTION_CASES.keys())
def test_paged_attention_matches_dense_causal_attention(case, heads, block_size, layout):
    num_heads, num_kv_heads = heads
    head_dim = 32
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}-{heads}-{block_size}".encode()))
    make_lens, num_decode_seqs = ATTENTION_CASES[case]
    seq_lens, query_lens = map(list, zip(*make_lens(block_size)))
    batch = make_paged_batch(seq_lens, query_lens, num_decode_seqs, block_size, gen)
    cache_shape = (batch.num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = random_cache(cache_shape, layout, gen)  # stale data wherever unwritten
    value_cache = random_cache(cache_shape, layout, gen)

    # Each sequence's whole context, dense; the earlier part is already in the cache.
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    for table, k, v, s, q_len in zip(batch.block_tables, keys, values, seq_lens, query_lens):
        slots = context_slots(table, block_size, range(s - q_len))
        reshape_and_cache(k[: s - q_len], v[: s - q_len], key_cache, value_cache, slots)
    # This step's tokens, in the flat order of the batch, as the attention layer writes them.
    new_k = torch.cat([k[s - q :] for k, s, q in zip(keys, seq_lens, query_lens)])
    new_v = torch.cat([v[s - q :] for v, s, q in zip(values, seq_lens, query_lens)])
    reshape_and_cache(new_k, new_v, key_cache, value_cache, batch.meta.slot_mapping)

    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = paged_attention(query, key_cache, value_cache, batch.meta, scale)

    assert out.shape == query.shape and out.dtype == query.dtype
    starts = batch.meta.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(keys, values)):
        q = query[starts[b] : starts[b + 1]]
        expected = naive_causal_attention(q, k, v, scale)
        err = max_err(out[starts[b] : starts[b + 1]], expected)
        assert err < ATOL, f"seq {b} (seq_len {seq_lens[b]}, query_len {query_lens[b]}): {err}"


@pytest.mark.parametrize("scores_bytes", [None, 200_000], ids=["default-tiles", "tiny-tiles"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
def test_paged_attention_long_prefill_and_extend(heads, scores_bytes, monkeypatch):
    """Query chunks over 1000 tokens: the reference computes their scores in tiles of
    queries (bounded in bytes), and the tiles' causal masks must line up."""
    if scores_bytes is not None:
        monkeypatch.setattr(reference, "_SCORES_BYTES", scores_bytes)
    num_heads, num_kv_heads = heads
    head_dim, block_size = 16, 16
    gen = torch.Generator().manual_seed(num_heads)
    seq_lens, query_lens = [1100, 1300, 9], [1100, 1050, 1]
    batch = make_paged_batch(seq_lens, query_lens, 0, block_size, gen)
    cache_shape = (batch.num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen)
    value_cache = torch.randn(cache_shape, generator=gen)
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    for table, k, v, s in zip(batch.block_tables, keys, values, seq_lens):
        slots = context_slots(table, block_size, range(s))
        reshape_and_cache(k, v, key_cache, value_cache, slots)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    out = paged_attention(query, key_cache, value_cache, batch.meta, 0.25)
    starts = batch.meta.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(keys, values)):
        expected = naive_causal_attention(query[starts[b] : starts[b + 1]], k, v, 0.25)
        assert max_err(out[starts[b] : starts[b + 1]], expected) < ATOL, b


ATTENTION_OPTIONS = {
    "alibi": {"alibi": True},
    "window-1": {"sliding_window": 1},
    "window-5": {"sliding_window": 5},
    "softcap": {"logit_softcap": 2.0},
    "sinks": {"sinks": True},
    "sinks-window-5": {"sinks": True, "sliding_window": 5},
    "all": {"alibi": True, "sliding_window": 7, "logit_softcap": 3.0},
    "all-sinks": {"alibi": True, "sliding_window": 7, "logit_softcap": 3.0, "sinks": True},
}


def write_batch(seq_lens, query_lens, num_decode_seqs, block_size, num_heads, num_kv_heads, gen):
    """A paged batch whose whole contexts are in the cache, with its dense keys, values and
    this step's queries: (batch, key_cache, value_cache, keys, values, query)."""
    head_dim = 16
    batch = make_paged_batch(seq_lens, query_lens, num_decode_seqs, block_size, gen)
    cache_shape = (batch.num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen)
    value_cache = torch.randn(cache_shape, generator=gen)
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    for table, k, v, s in zip(batch.block_tables, keys, values, seq_lens):
        reshape_and_cache(k, v, key_cache, value_cache, context_slots(table, block_size, range(s)))
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    return batch, key_cache, value_cache, keys, values, query


def alibi_test_slopes(num_heads: int, gen: torch.Generator) -> torch.Tensor:
    """Positive slopes of mixed sizes, as ALiBi's geometric series has them."""
    return torch.rand(num_heads, generator=gen) * 0.9 + 0.05


def sink_test_logits(num_heads: int, gen: torch.Generator) -> torch.Tensor:
    """Sink logits ~ N(0, 2), of the scores' own size, and head 0's far above every score
    (the sink, not a key, sets that row's max)."""
    sinks = 2.0 * torch.randn(num_heads, generator=gen)
    sinks[0] = 12.0
    return sinks


def option_kwargs(options: dict, num_heads: int, gen: torch.Generator) -> dict:
    """An ATTENTION_OPTIONS entry as paged_attention's keyword arguments."""
    kwargs = {k: v for k, v in options.items() if k not in ("alibi", "sinks")}
    if options.get("alibi"):
        kwargs["alibi_slopes"] = alibi_test_slopes(num_heads, gen)
    if options.get("sinks"):
        kwargs["sinks"] = sink_test_logits(num_heads, gen)
    return kwargs


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("options", ATTENTION_OPTIONS.values(), ids=ATTENTION_OPTIONS.keys())
@pytest.mark.parametrize("case", ["mixed", "extend", "many-decodes"])
def test_paged_attention_options_match_dense(case, options, heads):
    """ALiBi, sliding window, soft-cap and sinks, alone and together, on decodes, prefills
    and chunks over a cached prefix (windows shorter than the context, so keys drop out)."""
    num_heads, num_kv_heads = heads
    block_size = 4
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}-{options}-{heads}".encode()))
    make_lens, num_decode_seqs = ATTENTION_CASES[case]
    seq_lens, query_lens = map(list, zip(*make_lens(block_size)))
    batch, key_cache, value_cache, keys, values, query = write_batch(
        seq_lens, query_lens, num_decode_seqs, block_size, num_heads, num_kv_heads, gen
    )
    kwargs = option_kwargs(options, num_heads, gen)
    out = paged_attention(query, key_cache, value_cache, batch.meta, 0.3, **kwargs)
    starts = batch.meta.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(keys, values)):
        q = query[starts[b] : starts[b + 1]]
        expected = naive_causal_attention(q, k, v, 0.3, **kwargs)
        err = max_err(out[starts[b] : starts[b + 1]], expected)
        assert err < ATOL, f"seq {b} (seq_len {seq_lens[b]}, query_len {query_lens[b]}): {err}"


def test_sliding_window_changes_the_output_of_long_contexts():
    """The window is applied, not ignored: beyond it the output differs from full attention,
    and a window as long as the context equals full attention exactly."""
    gen = torch.Generator().manual_seed(3)
    batch, key_cache, value_cache, _, _, query = write_batch([30, 9], [1, 9], 1, 4, 4, 2, gen)
    full = paged_attention(query, key_cache, value_cache, batch.meta, 0.3)
    wide = paged_attention(query, key_cache, value_cache, batch.meta, 0.3, sliding_window=30)
    narrow = paged_attention(query, key_cache, value_cache, batch.meta, 0.3, sliding_window=8)
    assert torch.equal(full, wide)
    assert (full[0] - narrow[0]).abs().max() > 1e-3  # 30 keys, 8 seen
    # The 9-token prompt: positions 0..7 (rows 1..8) see at most 8 keys, all of them; position
    # 8 (row 9) would see 9 and loses key 0.
    assert torch.allclose(full[1:9], narrow[1:9])
    assert (full[9] - narrow[9]).abs().max() > 1e-3


@pytest.mark.parametrize("window", [None, 6])
def test_sinks_take_probability_from_the_keys(window):
    """Each head's output shrinks by its share of the softmax the sink takes: changed by
    ordinary sinks, all but unchanged by very negative ones, all but zero under huge ones;
    decodes and chunks alike."""
    gen = torch.Generator().manual_seed(5)
    batch, key_cache, value_cache, _, _, query = write_batch([30, 12], [1, 9], 1, 4, 4, 2, gen)

    def attend(sinks: torch.Tensor | None) -> torch.Tensor:
        meta = batch.meta
        return paged_attention(
            query, key_cache, value_cache, meta, 0.3, sliding_window=window, sinks=sinks
        )

    plain = attend(None)
    sunk = attend(torch.tensor([-1.0, 0.0, 1.0, 2.0]))
    per_head = (plain - sunk).abs().amax(dim=(0, 2))  # [num_heads]
    assert (per_head > 1e-2).all(), per_head
    assert sunk.norm(dim=-1).lt(plain.norm(dim=-1)).all()  # a zero value pulls towards 0
    torch.testing.assert_close(attend(torch.full((4,), -1e4)), plain, rtol=0, atol=1e-6)
    assert attend(torch.full((4,), 60.0)).abs().max() < 1e-12


def test_paged_attention_ignores_blocks_outside_the_tables():
    gen = torch.Generator().manual_seed(1)
    batch = make_paged_batch([6, 11], [1, 4], 1, 4, gen, num_spare_blocks=4)
    shape = (batch.num_blocks, 4, 2, 16)
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    query = torch.randn(5, 4, 16, generator=gen)
    before = paged_attention(query, key_cache, value_cache, batch.meta, 0.25)
    used = {b for table in batch.block_tables for b in table}
    for block_id in set(range(batch.num_blocks)) - used:
        key_cache[block_id] = 1e4 * torch.randn(4, 2, 16, generator=gen)
        value_cache[block_id] = 1e4 * torch.randn(4, 2, 16, generator=gen)
    after = paged_attention(query, key_cache, value_cache, batch.meta, 0.25)
    assert torch.equal(before, after)


# -- reshape_and_cache ----------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_reshape_and_cache_writes_exactly_the_mapped_slots(block_size):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 16, 3, 8, 12
    num_slots = num_blocks * block_size
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # e.g. padding tokens: written nowhere
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"))
    value_cache = torch.full(shape, float("nan"))

    reshape_and_cache(key, value, key_cache, value_cache, slots)

    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, block_size)
            assert torch.equal(key_cache[block, offset], key[i])
            assert torch.equal(value_cache[block, offset], value[i])
    written = torch.zeros(num_slots, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat_k = key_cache.view(num_slots, -1)
    flat_v = value_cache.view(num_slots, -1)
    assert not flat_k[written].isnan().any() and not flat_v[written].isnan().any()
    assert flat_k[~written].isnan().all() and flat_v[~written].isnan().all()


def test_reshape_and_cache_all_skipped_writes_nothing():
    key_cache = torch.full((2, 4, 1, 8), float("nan"))
    value_cache = torch.full((2, 4, 1, 8), float("nan"))
    kv = torch.randn(3, 1, 8)
    reshape_and_cache(kv, kv, key_cache, value_cache, torch.full((3,), -1, dtype=torch.long))
    assert key_cache.isnan().all() and value_cache.isnan().all()


def test_reshape_and_cache_casts_to_the_cache_dtype():
    key_cache = torch.zeros(2, 4, 2, 8, dtype=torch.float16)
    value_cache = torch.zeros(2, 4, 2, 8, dtype=torch.float16)
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([5, 0]))
    assert torch.equal(key_cache[1, 1], key[0].half())
    assert torch.equal(value_cache[0, 0], value[1].half())


# -- rms_norm, silu_and_mul -------------------------------------------------------------------------


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (weight.double() * x64 / torch.sqrt((x64**2).mean(-1, keepdim=True) + eps)).float()


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
@pytest.mark.parametrize("x_scale", [3.0, 1e-3])  # small inputs make eps matter
def test_rms_norm_matches_formula(eps, x_scale):
    gen = torch.Generator().manual_seed(0)
    x = x_scale * torch.randn(17, 96, generator=gen)
    weight = 1 + 0.1 * torch.randn(96, generator=gen)
    x_before = x.clone()
    out = rms_norm(x, weight, eps)
    assert max_err(out, naive_rms_norm(x, weight, eps)) < ATOL
    assert torch.equal(x, x_before)


def test_rms_norm_with_residual_adds_first_and_returns_the_sum():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 64, generator=gen)
    residual = torch.randn(9, 64, generator=gen)
    weight = 1 + 0.1 * torch.randn(64, generator=gen)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    assert max_err(new_residual, x + residual) < ATOL
    assert max_err(out, naive_rms_norm(x + residual, weight, 1e-6)) < ATOL
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_matches_hf_llama_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(2)
    hf = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * torch.randn(48, generator=gen))
    x = torch.randn(5, 48, generator=gen)
    with torch.no_grad():
        assert max_err(rms_norm(x, hf.weight, 1e-5), hf(x)) < ATOL


def test_silu_and_mul_matches_formula():
    gen = torch.Generator().manual_seed(3)
    x = 4 * torch.randn(13, 2 * 40, generator=gen)
    gate, up = x[:, :40].double(), x[:, 40:].double()
    expected = (gate / (1 + torch.exp(-gate)) * up).float()
    out = silu_and_mul(x)
    assert out.shape == (13, 40)
    assert max_err(out, expected) < ATOL


# -- rotary_embedding -----------------------------------------------------------------------------


def make_cos_sin_cache(rotary_dim: int, max_position: int, base: float) -> torch.Tensor:
    """[max_position, rotary_dim]: cos of each frequency, then sin (the kernel's layout)."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def hf_cos_sin(head_dim: int, positions: torch.Tensor, base: float):
    """cos, sin `[num_tokens, head_dim]` from HF's own LlamaRotaryEmbedding."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_theta=base,
        max_position_embeddings=4096,
    )
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None, :])
    return cos[0], sin[0]


@pytest.mark.parametrize(("head_dim", "base"), [(64, 10000.0), (32, 500000.0), (16, 1e6)])
def test_rotary_neox_matches_hf_apply_rotary_pos_emb(head_dim, base):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.tensor([0, 1, 2, 7, 8, 100, 511, 2047, 3, 3])
    query = torch.randn(len(positions), 9, head_dim, generator=gen)
    key = torch.randn(len(positions), 3, head_dim, generator=gen)
    cache = make_cos_sin_cache(head_dim, 2048, base)
    q_before, k_before = query.clone(), key.clone()

    q_out, k_out = rotary_embedding(positions, query, key, cache, is_neox_style=True)

    cos, sin = hf_cos_sin(head_dim, positions, base)
    # [T, heads, head_dim] with cos [T, head_dim]: unsqueeze at dim 1 broadcasts over heads.
    q_hf, k_hf = apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=1)
    assert max_err(q_out, q_hf) < ATOL and max_err(k_out, k_hf) < ATOL
    assert torch.equal(query, q_before) and torch.equal(key, k_before)
    # Position 0 is the identity.
    assert torch.equal(q_out[0], query[0]) and torch.equal(k_out[0], key[0])


def test_rotary_neox_partial_rotary_dim_leaves_the_rest():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(5)
    head_dim, rotary_dim = 64, 16
    positions = torch.tensor([5, 0, 300, 42])
    query = torch.randn(4, 4, head_dim, generator=gen)
    key = torch.randn(4, 2, head_dim, generator=gen)
    cache = make_cos_sin_cache(rotary_dim, 512, 10000.0)
    q_out, k_out = rotary_embedding(positions, query, key, cache)
    cos, sin = hf_cos_sin(rotary_dim, positions, 10000.0)
    q_hf, k_hf = apply_rotary_pos_emb(
        query[..., :rotary_dim], key[..., :rotary_dim], cos, sin, unsqueeze_dim=1
    )
    assert max_err(q_out[..., :rotary_dim], q_hf) < ATOL
    assert max_err(k_out[..., :rotary_dim], k_hf) < ATOL
    assert torch.equal(q_out[..., rotary_dim:], query[..., rotary_dim:])
    assert torch.equal(k_out[..., rotary_dim:], key[..., rotary_dim:])


def naive_rotary_gptj(
    x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, base: float
) -> torch.Tensor:
    """Rotate each interleaved pair (2i, 2i+1) by position * base^(-2i/rotary_dim)."""
    # The angles in float32, as the cache computes them, so large positions agree to rounding.
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
    out = x.double().clone()
    for t in range(len(positions)):
        for i in range(rotary_dim // 2):
            c, s = math.cos(angles[t, i].item()), math.sin(angles[t, i].item())
            a, b = x[t, :, 2 * i].double(), x[t, :, 2 * i + 1].double()
            out[t, :, 2 * i] = a * c - b * s
            out[t, :, 2 * i + 1] = b * c + a * s
    return out.float()


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 16), (32, 8)])
def test_rotary_gptj_matches_naive_interleaved(head_dim, rotary_dim):
    gen = torch.Generator().manual_seed(rotary_dim)
    positions = torch.tensor([0, 1, 9, 255, 1000])
    query = torch.randn(len(positions), 3, head_dim, generator=gen)
    key = torch.randn(len(positions), 1, head_dim, generator=gen)
    cache = make_cos_sin_cache(rotary_dim, 1024, 10000.0)
    q_out, k_out = rotary_embedding(positions, query, key, cache, is_neox_style=False)
    assert max_err(q_out, naive_rotary_gptj(query, positions, rotary_dim, 10000.0)) < ATOL
    assert max_err(k_out, naive_rotary_gptj(key, positions, rotary_dim, 10000.0)) < ATOL


def test_rotary_preserves_norms_and_relative_angles():
    # A rotation: per-pair norms are kept, and q.k depends only on the position difference.
    gen = torch.Generator().manual_seed(6)
    cache = make_cos_sin_cache(32, 256, 10000.0)
    q = torch.randn(1, 1, 32, generator=gen).expand(2, 1, 32).contiguous()
    k = torch.randn(1, 1, 32, generator=gen).expand(2, 1, 32).contiguous()
    for neox in (True, False):
        q_a, k_a = rotary_embedding(torch.tensor([3, 10]), q, k, cache, neox)
        q_b, k_b = rotary_embedding(torch.tensor([50, 57]), q, k, cache, neox)
        dot_a = (q_a[1] * k_a[0]).sum()
        dot_b = (q_b[1] * k_b[0]).sum()
        assert abs(dot_a.item() - dot_b.item()) < 1e-4
        assert max_err(q_a.norm(dim=-1), q.norm(dim=-1)) < 1e-5


def test_scaled_dot_product_reference_is_what_we_think():
    # Guards the oracle itself: softmax(QK^T * scale)V for one unmasked query row.
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 1, 8, generator=gen) for _ in range(3))
    k = torch.cat([k, torch.randn(4, 1, 8, generator=gen)])
    v = torch.cat([v, torch.randn(4, 1, 8, generator=gen)])
    expected = F.softmax((q[0] @ k[:, 0].T) * 0.3, dim=-1) @ v[:, 0]
    assert max_err(naive_causal_attention(q, k, v, 0.3)[0], expected) < ATOL


def test_top_p_cut_sorts_only_the_rows_past_its_candidates(monkeypatch):
    """The reference looks for each row's top-p edge among its likeliest tokens (here 8 of
    64) and sorts only the rows whose nucleus is wider; either way the edge is the one a
    float64 sort gives."""
    monkeypatch.setattr(reference, "TOP_P_CANDIDATES", 8)
    searched = []
    nucleus_edge = reference.nucleus_edge

    def recorded(logits, top_p, count):
        searched.append((logits.shape[0], count))
        return nucleus_edge(logits, top_p, count)

    monkeypatch.setattr(reference, "nucleus_edge", recorded)
    gen = torch.Generator().manual_seed(5)
    peaked = torch.randn(2, 64, generator=gen) * 6
    flat = torch.randn(1, 64, generator=gen) * 0.2
    logits = torch.cat([peaked, flat])
    top_p = torch.tensor([0.9, 0.5, 0.9])
    cut = reference.top_p_cut(logits, top_p).flatten().tolist()
    assert searched == [(3, 8), (1, 64)]
    for row, p in enumerate(top_p.tolist()):
        values = logits[row].double().sort(descending=True).values
        probs = values.softmax(dim=0)
        kept = int(((probs.cumsum(0) - probs) < p).sum())
        assert cut[row] == float(values[kept - 1])
