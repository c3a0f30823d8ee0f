"""The Triton paged attention kernels against the torch reference, on fresh random inputs.

Outputs start as NaN so an element no program writes shows; unwritten cache slots hold
random stale data (or NaN, where the oracle is the dense attention), so reading the wrong
block or an unmasked block tail gives a wrong answer instead of a lucky zero.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_cases import (
    GQA_LAYOUTS,
    TOLERANCE,
    AttentionInputs,
    make_attention_inputs,
    poisoned_like,
    rel_err,
    to_device,
)
from kernels.test_reference import ATTENTION_CASES, naive_causal_attention

from serve.kernels import reference
from serve.kernels.metadata import AttentionMetadata


@pytest.fixture(scope="module")
def triton_ops():
    from serve.kernels import triton as ops

    return ops


def seeded(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def check_against_reference(ops, inputs: AttentionInputs, scale: float, **kwargs) -> None:
    out = ops.paged_attention(
        inputs.query,
        inputs.key_cache,
        inputs.value_cache,
        inputs.meta,
        scale,
        out=poisoned_like(inputs.query),
        **kwargs,
    )
    # The oracle is the reference in float32 on the same (possibly rounded) data.
    expected = reference.paged_attention(
        inputs.query.float(),
        inputs.key_cache.float(),
        inputs.value_cache.float(),
        inputs.meta,
        scale,
    )
    assert out.dtype == inputs.query.dtype
    err = rel_err(out, expected)
    assert err < TOLERANCE[inputs.query.dtype], err


@pytest.mark.parametrize("heads", GQA_LAYOUTS.values(), ids=GQA_LAYOUTS.keys())
@pytest.mark.parametrize("case", ["decode", "prefill", "extend", "mixed"])
def test_paged_attention_matches_reference(triton_ops, device, case, heads):
    make_lens, num_decode_seqs = ATTENTION_CASES[case]
    gen = seeded(case, heads)
    inputs = make_attention_inputs(
        make_lens(16), num_decode_seqs, heads, 32, 16, gen, device=device
    )
    check_against_reference(triton_ops, inputs, 32**-0.5)


@pytest.mark.parametrize("heads", [(4, 4), (14, 2)], ids=["mha", "gqa7"])
@pytest.mark.parametrize("case", ["decode", "extend", "mixed"])
def test_block_size_32_contiguous_cache(triton_ops, device, case, heads):
    """The CUDA cache engine's layout (contiguous) with the larger block size."""
    make_lens, num_decode_seqs = ATTENTION_CASES[case]
    gen = seeded(case, heads, 32)
    inputs = make_attention_inputs(
        make_lens(32), num_decode_seqs, heads, 32, 32, gen, device=device, layout="contiguous"
    )
    check_against_reference(triton_ops, inputs, 32**-0.5)


def test_many_decodes_of_mixed_lengths(triton_ops, device):
    make_lens, num_decode_seqs = ATTENTION_CASES["many-decodes"]
    gen = seeded("many-decodes")
    inputs = make_attention_inputs(
        make_lens(16), num_decode_seqs, (9, 3), 32, 16, gen, device=device
    )
    check_against_reference(triton_ops, inputs, 32**-0.5)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_sizes(triton_ops, device, head_dim):
    """80 and 96 pad to 128 lanes; the padding must be masked on load and store."""
    gen = seeded("head_dim", head_dim)
    lens = [(17, 1), (33, 1), (20, 20), (40, 7)]
    inputs = make_attention_inputs(lens, 2, (4, 2), head_dim, 16, gen, device=device)
    check_against_reference(triton_ops, inputs, head_dim**-0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_half_precision(triton_ops, device, dtype, block_size):
    gen = seeded("dtype", dtype, block_size)
    lens = [(block_size + 1, 1), (3, 1), (2 * block_size, 2 * block_size), (50, 9)]
    inputs = make_attention_inputs(lens, 2, (9, 3), 64, block_size, gen, dtype=dtype, device=device)
    check_against_reference(triton_ops, inputs, 64**-0.5)


def test_unwritten_cache_slots_are_never_read(triton_ops, device):
    """Every slot outside the contexts is NaN: one unmasked read of a block's tail or of a
    spare block makes the output NaN. The oracle is dense attention on the contexts."""
    gen = seeded("nan-stale")
    lens = [(5, 1), (16, 1), (17, 1), (1, 1), (23, 23), (40, 8), (9, 1)]
    inputs = make_attention_inputs(lens, 4, (8, 2), 32, 16, gen, device=device, stale="nan")
    out = triton_ops.paged_attention(
        inputs.query,
        inputs.key_cache,
        inputs.value_cache,
        inputs.meta,
        0.2,
        out=poisoned_like(inputs.query),
    ).cpu()
    starts = inputs.meta.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(inputs.keys, inputs.values)):
        rows = slice(starts[b], starts[b + 1])
        expected = naive_causal_attention(inputs.query[rows].cpu(), k, v, 0.2)
        assert rel_err(out[rows], expected) < TOLERANCE[torch.float32], b


def test_sequences_sharing_blocks(triton_ops, device):
    """A prefix-cache hit: three sequences share their first two blocks (and one a partial
    third), read at once by a decode, an extend chunk and a short chunk."""
    gen = seeded("shared")
    block_size, num_kv_heads, head_dim = 16, 2, 32
    num_blocks = 12
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    tables = [[7, 2, 9], [7, 2, 4, 11], [7, 2, 9, 5]]
    seq_lens, query_lens = [40, 60, 50], [1, 12, 3]
    meta = AttentionMetadata(
        slot_mapping=torch.full((sum(query_lens),), -1, dtype=torch.long),
        block_tables=torch.tensor([t + [0] * (4 - len(t)) for t in tables]),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=torch.tensor([0, 1, 13, 16]),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
        num_decode_seqs=1,
    )
    query = torch.randn(sum(query_lens), 8, head_dim, generator=gen)
    inputs = AttentionInputs(
        query.to(device),
        key_cache.to(device),
        value_cache.to(device),
        to_device(meta, device),
        [],
        [],
        tables,
    )
    check_against_reference(triton_ops, inputs, head_dim**-0.5)


# -- decode: flash-decoding splits ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 2, 4, 8])
def test_decode_splits_agree(triton_ops, device, num_splits, dtype):
    """Splits that are empty for short sequences (8 splits of 3 tokens) must merge to nothing."""
    from serve.kernels.triton.decode_attention import decode_attention

    gen = seeded("splits", num_splits)
    lens = [(3, 1), (300, 1), (129, 1), (64, 1), (1, 1)]
    inputs = make_attention_inputs(lens, 5, (8, 2), 32, 16, gen, dtype=dtype, device=device)
    meta = inputs.meta
    out = decode_attention(
        inputs.query,
        inputs.key_cache,
        inputs.value_cache,
        meta.block_tables,
        meta.seq_lens,
        max(meta.seq_lens_cpu),
        0.25,
        out=poisoned_like(inputs.query),
        num_splits=num_splits,
    )
    expected = reference.paged_attention(
        inputs.query.float(), inputs.key_cache.float(), inputs.value_cache.float(), meta, 0.25
    )
    assert rel_err(out, expected) < TOLERANCE[dtype]


def test_split_heuristic():
    from serve.kernels.triton.decode_attention import choose_num_splits

    # Enough sequences x KV heads to fill 132 SMs several times over, or short contexts: no split.
    assert choose_num_splits(256, 8, 8192, 132) == 1
    assert choose_num_splits(1, 8, 300, 132) == 1
    # A lone long sequence: as many splits as allowed.
    assert choose_num_splits(1, 8, 8192, 132) == 16
    # Powers of two, never splits shorter than MIN_TOKENS_PER_SPLIT.
    for batch in (1, 4, 16, 64):
        for context in (512, 2048, 8192):
            n = choose_num_splits(batch, 8, context, 132)
            assert n & (n - 1) == 0 and (n == 1 or context // n >= 256)
    assert choose_num_splits(16, 8, 2048, 132) >= 2


# -- prefill: tiling ------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [(4, 4), (9, 3)], ids=["mha", "gqa3"])
def test_prefill_small_tiles(triton_ops, device, heads):
    """16x16 tiles make these chunks span several query tiles and several unmasked key tiles
    before the diagonal, with a cached prefix that ends mid-block and mid-tile."""
    from serve.kernels.triton.prefill_attention import PrefillTiles, prefill_attention

    gen = seeded("tiles", heads)
    lens = [(70, 45), (37, 37), (90, 3), (18, 17), (1, 1)]
    inputs = make_attention_inputs(lens, 0, heads, 16, 16, gen, device=device)
    meta = inputs.meta
    out = prefill_attention(
        inputs.query,
        inputs.key_cache,
        inputs.value_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        first_seq=0,
        max_query_len=max(meta.query_lens_cpu),
        scale=0.25,
        out=poisoned_like(inputs.query),
        tiles=PrefillTiles(block_m=16, block_n=16, num_warps=2, num_stages=1),
    )
    expected = reference.paged_attention(
        inputs.query, inputs.key_cache, inputs.value_cache, meta, 0.25
    )
    assert rel_err(out, expected) < TOLERANCE[torch.float32]
