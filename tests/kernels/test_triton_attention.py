"""The Triton paged attention kernels against the torch reference, on fresh random inputs.

Outputs start as NaN so an element no program writes shows; unwritten cache slots hold
random stale data (or NaN, where the oracle is the dense attention), so reading the wrong
block or an unmasked block tail gives a wrong answer instead of a lucky zero.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
import triton
import triton.language as tl
from kernel_cases import (
    GQA_LAYOUTS,
    TOLERANCE,
    AttentionInputs,
    make_attention_inputs,
    poisoned_like,
    rel_err,
    to_device,
)
from kernels.test_reference import (
    ATTENTION_CASES,
    ATTENTION_OPTIONS,
    naive_causal_attention,
    option_kwargs,
    sink_test_logits,
)

from serve.kernels import reference
from serve.kernels.metadata import AttentionMetadata
from serve.kernels.triton.attention_options import soft_cap


@pytest.fixture(scope="module")
def triton_ops():
    from serve.kernels import triton as ops

    return ops


def seeded(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def check_against_reference(ops, inputs: AttentionInputs, scale: float, **options) -> None:
    """`options`: the attention options (alibi_slopes, sliding_window, logit_softcap, sinks)."""
    out = ops.paged_attention(
        inputs.query,
        inputs.key_cache,
        inputs.value_cache,
        inputs.meta,
        scale,
        out=poisoned_like(inputs.query),
        **options,
    )
    # The oracle is the reference in float32 on the same (possibly rounded) data.
    expected = reference.paged_attention(
        inputs.query.float(),
        inputs.key_cache.float(),
        inputs.value_cache.float(),
        inputs.meta,
        scale,
        **options,
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


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float8_e4m3fn),
        (torch.bfloat16, torch.float8_e4m3fn),
        (torch.bfloat16, torch.float8_e5m2),
    ],
    ids=str,
)
def test_queries_over_a_narrower_cache(triton_ops, device, dtype, cache_dtype):
    """--kv-cache-dtype: K/V stored narrower than the model computes, widened as they load."""
    gen = seeded("narrow-cache", dtype, cache_dtype)
    lens = [(17, 1), (3, 1), (32, 32), (50, 9)]
    inputs = make_attention_inputs(lens, 2, (9, 3), 64, 16, gen, device=device)
    narrow = dataclasses.replace(
        inputs,
        query=inputs.query.to(dtype),
        key_cache=inputs.key_cache.to(cache_dtype),
        value_cache=inputs.value_cache.to(cache_dtype),
    )
    check_against_reference(triton_ops, narrow, 64**-0.5)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_unwritten_cache_slots_are_never_read(triton_ops, device, with_sinks):
    """Every slot outside the contexts is NaN: one unmasked read of a block's tail or of a
    spare block makes the output NaN. The oracle is dense attention on the contexts."""
    gen = seeded("nan-stale")
    lens = [(5, 1), (16, 1), (17, 1), (1, 1), (23, 23), (40, 8), (9, 1)]
    inputs = make_attention_inputs(lens, 4, (8, 2), 32, 16, gen, device=device, stale="nan")
    sinks = sink_test_logits(8, gen) if with_sinks else None
    out = triton_ops.paged_attention(
        inputs.query,
        inputs.key_cache,
        inputs.value_cache,
        inputs.meta,
        0.2,
        sinks=None if sinks is None else sinks.to(device),
        out=poisoned_like(inputs.query),
    ).cpu()
    starts = inputs.meta.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(inputs.keys, inputs.values)):
        rows = slice(starts[b], starts[b + 1])
        expected = naive_causal_attention(inputs.query[rows].cpu(), k, v, 0.2, sinks=sinks)
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


# -- options: ALiBi, sliding window, logit soft-cap ----------------------------------------------


def options_kwargs(options: dict, num_heads: int, gen: torch.Generator, device) -> dict:
    """An ATTENTION_OPTIONS entry as paged_attention's keyword arguments, on `device`."""
    kwargs = option_kwargs(options, num_heads, gen)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


OPTION_HEADS = {"gqa3": (6, 2), "mqa": (4, 1)}


@pytest.mark.parametrize("heads", OPTION_HEADS.values(), ids=OPTION_HEADS.keys())
@pytest.mark.parametrize("options", ATTENTION_OPTIONS.values(), ids=ATTENTION_OPTIONS.keys())
@pytest.mark.parametrize("case", ["decode", "prefill", "extend", "mixed"])
def test_options_match_reference(triton_ops, device, case, options, heads):
    """Each option alone and all together, through the batch op, on block size 4: windows of
    1, 5 and 7 keys are shorter than most contexts (up to 11 blocks), so keys drop out."""
    make_lens, num_decode_seqs = ATTENTION_CASES[case]
    gen = seeded("options", case, options, heads)
    inputs = make_attention_inputs(make_lens(4), num_decode_seqs, heads, 16, 4, gen, device=device)
    kwargs = options_kwargs(options, heads[0], gen, device)
    check_against_reference(triton_ops, inputs, 0.3, **kwargs)


# Windows around the decode kernel's 64-key tiles and the 16-key tiles of the prefill tests.
WINDOWED_OPTIONS = {
    "window-1": {"sliding_window": 1},
    "window-17": {"sliding_window": 17},
    "window-70": {"sliding_window": 70},
    "all-window-40": {"alibi": True, "sliding_window": 40, "logit_softcap": 5.0},
    "sinks-window-17": {"sinks": True, "sliding_window": 17},
}


@pytest.mark.parametrize("options", WINDOWED_OPTIONS.values(), ids=WINDOWED_OPTIONS.keys())
@pytest.mark.parametrize("num_splits", [1, 2, 8])
def test_decode_options_with_splits(triton_ops, device, num_splits, options):
    """The splits share the window's keys: a window over a long context starts past whole
    tiles, and 8 splits of a short window leave most of them empty for the merge."""
    from serve.kernels.triton.decode_attention import decode_attention

    gen = seeded("decode-options", num_splits, options)
    lens = [(3, 1), (300, 1), (129, 1), (64, 1), (1, 1), (200, 1)]
    inputs = make_attention_inputs(lens, 6, (8, 2), 32, 16, gen, device=device)
    kwargs = options_kwargs(options, 8, gen, device)
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
        **kwargs,
    )
    expected = reference.paged_attention(
        inputs.query, inputs.key_cache, inputs.value_cache, meta, 0.25, **kwargs
    )
    assert rel_err(out, expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 2, 8])
def test_decode_sinks_fold_in_once_across_splits(triton_ops, device, num_splits, dtype):
    """A sink joins the whole context's softmax once: in the one split's program, or in the
    merge, never once per split (8 splits of short contexts leave most of them empty).
    Against the dense oracle; and the sinks change the output."""
    from serve.kernels.triton.decode_attention import decode_attention

    gen = seeded("decode-sinks", num_splits, dtype)
    lens = [(3, 1), (300, 1), (129, 1), (64, 1), (1, 1), (200, 1)]
    inputs = make_attention_inputs(lens, 6, (8, 2), 32, 16, gen, dtype=dtype, device=device)
    sinks = sink_test_logits(8, gen)
    meta = inputs.meta

    def decode(sinks: torch.Tensor | None) -> torch.Tensor:
        return decode_attention(
            inputs.query, inputs.key_cache, inputs.value_cache, meta.block_tables,
            meta.seq_lens, max(meta.seq_lens_cpu), 0.25, out=poisoned_like(inputs.query),
            num_splits=num_splits, sinks=sinks,
        ).cpu()  # fmt: skip

    out = decode(sinks.to(device))
    expected = torch.cat(
        [
            naive_causal_attention(q[None].float().cpu(), k.float(), v.float(), 0.25, sinks=sinks)
            for q, k, v in zip(inputs.query, inputs.keys, inputs.values)
        ]
    )
    assert rel_err(out, expected) < TOLERANCE[dtype]
    assert rel_err(decode(None), expected) > 10 * TOLERANCE[dtype]


def prefill_small_tiles(inputs: AttentionInputs, scale: float, **options) -> torch.Tensor:
    """The prefill kernel alone with 16x16 tiles: chunks span several query tiles, and a
    window several key tiles."""
    from serve.kernels.triton.prefill_attention import PrefillTiles, prefill_attention

    meta = inputs.meta
    return prefill_attention(
        inputs.query,
        inputs.key_cache,
        inputs.value_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        first_seq=0,
        max_query_len=max(meta.query_lens_cpu),
        scale=scale,
        out=poisoned_like(inputs.query),
        tiles=PrefillTiles(block_m=16, block_n=16, num_warps=2, num_stages=1),
        **options,
    )


@pytest.mark.parametrize("heads", OPTION_HEADS.values(), ids=OPTION_HEADS.keys())
@pytest.mark.parametrize("options", WINDOWED_OPTIONS.values(), ids=WINDOWED_OPTIONS.keys())
def test_prefill_options_small_tiles(triton_ops, device, options, heads):
    """Windows shorter than a tile (rows that see nothing of the first tiles read), as long
    as one, and longer than several: window-edge, whole and diagonal tiles, chunks over a
    cached prefix ending mid-tile, and a window longer than the context."""
    gen = seeded("prefill-options", options, heads)
    lens = [(100, 45), (37, 37), (90, 3), (18, 17), (1, 1), (64, 64)]
    inputs = make_attention_inputs(lens, 0, heads, 16, 16, gen, device=device)
    kwargs = options_kwargs(options, heads[0], gen, device)
    out = prefill_small_tiles(inputs, 0.25, **kwargs)
    expected = reference.paged_attention(
        inputs.query, inputs.key_cache, inputs.value_cache, inputs.meta, 0.25, **kwargs
    )
    assert rel_err(out, expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_window_never_reads_keys_before_it(triton_ops, device, kernel):
    """The keys no query's window reaches are NaN: reading one (even masked, since its p of 0
    meets a NaN value) makes the output NaN. The decode kernel reads nothing before the
    window; the prefill kernel, nothing before the tile holding its first query's window."""
    gen = seeded("window-skip", kernel)
    window = 20
    if kernel == "decode":
        lens, num_decodes, first_unread = [(300, 1), (150, 1), (90, 1), (21, 1)], 4, 0
    else:
        lens, num_decodes, first_unread = [(150, 40), (90, 90), (100, 17)], 0, 16
    inputs = make_attention_inputs(lens, num_decodes, (8, 2), 16, 16, gen, device=device)
    expected = reference.paged_attention(
        inputs.query,
        inputs.key_cache,
        inputs.value_cache,
        inputs.meta,
        0.25,
        sliding_window=window,
    )
    block_size = 16
    for table, (seq_len, q_len) in zip(inputs.block_tables, lens):
        # Keys before the first query's window, rounded down to the kernel's unit of reading.
        unread = max(seq_len - q_len - window + 1, 0)
        if first_unread:
            unread = unread // first_unread * first_unread
        for pos in range(unread):
            slot = (table[pos // block_size], pos % block_size)
            inputs.key_cache[slot] = float("nan")
            inputs.value_cache[slot] = float("nan")
    if kernel == "decode":
        out = triton_ops.paged_attention(
            inputs.query,
            inputs.key_cache,
            inputs.value_cache,
            inputs.meta,
            0.25,
            sliding_window=window,
            out=poisoned_like(inputs.query),
        )
    else:
        out = prefill_small_tiles(inputs, 0.25, sliding_window=window)
    assert rel_err(out, expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("options", ["all", "all-sinks"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_options_half_precision(triton_ops, device, dtype, options):
    gen = seeded("options-dtype", dtype)
    lens = [(40, 1), (3, 1), (33, 33), (50, 9)]
    inputs = make_attention_inputs(lens, 2, (9, 3), 32, 16, gen, dtype=dtype, device=device)
    kwargs = options_kwargs(ATTENTION_OPTIONS[options], 9, gen, device)
    check_against_reference(triton_ops, inputs, 32**-0.5, **kwargs)


def test_soft_cap_saturates_large_scores(triton_ops, device):
    """Scores far beyond the cap (|s| up to ~100 against a cap of 1): tanh must saturate to
    +-1, not overflow to NaN; the capped scores then tie and the output averages values."""
    gen = seeded("softcap-large")
    inputs = make_attention_inputs(
        [(40, 1), (9, 1), (30, 30), (45, 12)], 2, (4, 2), 16, 16, gen, device=device
    )
    inputs.query.mul_(20.0)
    check_against_reference(triton_ops, inputs, 1.0, logit_softcap=1.0)
    check_against_reference(triton_ops, inputs, 1.0, logit_softcap=30.0)


@triton.jit
def _soft_cap_kernel(x_ptr, out_ptr, cap, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, soft_cap(tl.load(x_ptr + offs), cap))


def test_soft_cap_is_tanh(device):
    """The kernels' tanh against torch's, from 0 through saturation, both signs."""
    magnitudes = torch.cat([torch.zeros(1), torch.logspace(-6, 4, 127)])
    x = torch.cat([magnitudes, -magnitudes]).to(device)  # [256]
    for cap in (0.5, 1.0, 50.0):
        out = torch.empty_like(x)
        _soft_cap_kernel[(1,)](x, out, cap, N=256)
        expected = cap * torch.tanh(x.double() / cap)
        assert (out.double() - expected).abs().max().item() < 4e-7 * cap
        assert out[magnitudes.numel() - 1].item() == cap  # saturated exactly


def bad_option_cases(num_heads: int, device) -> dict[str, tuple[dict, str]]:
    slopes = torch.rand(num_heads)
    return {
        "slopes-shape": ({"alibi_slopes": torch.rand(num_heads + 1).to(device)}, "shape"),
        "slopes-2d": ({"alibi_slopes": slopes.view(1, -1).to(device)}, "shape"),
        "slopes-dtype": ({"alibi_slopes": slopes.double().to(device)}, "float32"),
        "slopes-device": ({"alibi_slopes": slopes.to("meta")}, "device"),
        "slopes-strided": (
            {"alibi_slopes": torch.rand(2 * num_heads, device=device)[::2]},  # a view
            "contiguous",
        ),
        "slopes-list": ({"alibi_slopes": slopes.tolist()}, "tensor"),
        "window-0": ({"sliding_window": 0}, ">= 1"),
        "window-float": ({"sliding_window": 4.0}, "int"),
        "softcap-0": ({"logit_softcap": 0.0}, "> 0"),
        "softcap-negative": ({"logit_softcap": -5.0}, "> 0"),
        "softcap-inf": ({"logit_softcap": float("inf")}, "finite"),
        "softcap-nan": ({"logit_softcap": float("nan")}, "> 0"),
        "sinks-shape": ({"sinks": torch.rand(num_heads - 1).to(device)}, "shape"),
        "sinks-dtype": (
            {"sinks": torch.rand(num_heads, dtype=torch.bfloat16).to(device)},
            "float32",
        ),
        "sinks-device": ({"sinks": slopes.to("meta")}, "device"),
    }


BAD_OPTIONS = list(bad_option_cases(4, "cpu"))


@pytest.mark.parametrize("case", BAD_OPTIONS)
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_bad_options_are_value_errors(triton_ops, device, kernel, case):
    lens = [(9, 1)] if kernel == "decode" else [(9, 4)]
    inputs = make_attention_inputs(
        lens, int(kernel == "decode"), (4, 2), 16, 16, seeded("bad"), device=device
    )
    options, message = bad_option_cases(4, device)[case]
    with pytest.raises(ValueError, match=message):
        triton_ops.paged_attention(
            inputs.query, inputs.key_cache, inputs.value_cache, inputs.meta, 0.25, **options
        )
