"""The native CPU kernels (serve/kernels/cpu): paged attention against the dense float64
oracle and the torch reference, the few-row linear against torch, on fresh random inputs;
and what happens where they cannot be built.

Outputs start as NaN so a row the kernel skips shows; unwritten cache slots hold NaN, so
reading a wrong block or past a context's end poisons the answer instead of adding noise.
"""

from __future__ import annotations

import dataclasses
import logging
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
)
from kernels.test_reference import (
    ATTENTION_CASES,
    ATTENTION_OPTIONS,
    make_cos_sin_cache,
    naive_causal_attention,
    option_kwargs,
    sink_test_logits,
)

from serve.kernels import cpu, reference
from serve.kernels.cpu import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ toolchain to build with")


def seeded(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def native_attention(inputs: AttentionInputs, scale: float, **options) -> torch.Tensor:
    out = poisoned_like(inputs.query)
    torch.ops.serve_cpu.paged_attention(
        out,
        inputs.query,
        inputs.key_cache,
        inputs.value_cache,
        inputs.meta.block_tables,
        inputs.meta.seq_lens,
        inputs.meta.query_start_loc,
        scale,
        options.get("alibi_slopes"),
        options.get("sliding_window") or 0,
        options.get("logit_softcap") or 0.0,
        options.get("sinks"),
    )
    return out


def assert_matches_dense(inputs: AttentionInputs, out: torch.Tensor, scale: float, **options):
    starts = inputs.meta.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(inputs.keys, inputs.values)):
        rows = slice(starts[b], starts[b + 1])
        expected = naive_causal_attention(inputs.query[rows], k, v, scale, **options)
        err = rel_err(out[rows], expected)
        assert err < TOLERANCE[torch.float32], f"seq {b} {inputs.meta.seq_lens_cpu[b]}: {err}"


def case_inputs(case: str, heads, head_dim: int, block_size: int, **kwargs) -> AttentionInputs:
    make_lens, num_decode_seqs = ATTENTION_CASES[case]
    gen = seeded(case, heads, head_dim, block_size, kwargs.get("layout"))
    return make_attention_inputs(
        make_lens(block_size), num_decode_seqs, heads, head_dim, block_size, gen, **kwargs
    )


@pytest.mark.parametrize("layout", ["heads_first", "contiguous"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", GQA_LAYOUTS.values(), ids=GQA_LAYOUTS.keys())
@pytest.mark.parametrize("case", ATTENTION_CASES.keys())
def test_native_kernel_matches_dense_attention(case, heads, block_size, layout):
    """Decodes, whole prompts, chunks over a cached prefix and mixes of them, every
    sequence in the native kernel (longer chunks span several query tiles)."""
    inputs = case_inputs(case, heads, 16, block_size, layout=layout, stale="nan")
    assert_matches_dense(inputs, native_attention(inputs, 0.3), 0.3)


@pytest.mark.parametrize("heads", GQA_LAYOUTS.values(), ids=GQA_LAYOUTS.keys())
@pytest.mark.parametrize("head_dim", [16, 32, 40, 64, 72, 80, 96, 128])
def test_head_sizes_with_and_without_a_tail_slice(head_dim, heads):
    """head_dim in 16-float slices (64: one group of four; 40 and 72: scalar tails), with
    the query heads of a KV head attended together in groups of up to four (32, 64), three
    (80) or two (96, 128): a KV head's 1, 3, 4, 7 or 8 heads fill groups whole or not."""
    inputs = case_inputs("mixed", heads, head_dim, 16, stale="nan")
    scale = head_dim**-0.5
    assert_matches_dense(inputs, native_attention(inputs, scale), scale)


PROMPT_OPTIONS = {
    "causal": {},
    "window": {"sliding_window": 21},
    "sinks": {"sinks": True},
    "sinks-window": {"sinks": True, "sliding_window": 21},
}


@pytest.mark.parametrize("options", PROMPT_OPTIONS.values(), ids=PROMPT_OPTIONS.keys())
@pytest.mark.parametrize("layout", ["heads_first", "contiguous"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prompt_tiles_of_the_common_head_sizes(head_dim, layout, options):
    """Prompts and chunks at head sizes 64 and 128, where key groups are read from the cache
    as they lie (heads-first float32 blocks of 16) or copied (the other layout; a context
    ending mid-group, its slots past the end NaN); a window that starts mid-group; sinks
    folded into each lane's softmax."""
    inputs = make_attention_inputs(
        [(75, 75), (100, 37), (48, 48), (70, 12)],
        0,
        (6, 2),
        head_dim,
        16,
        seeded("prompt tiles", head_dim, layout),
        layout=layout,
        stale="nan",
    )
    scale = head_dim**-0.5
    kwargs = option_kwargs(options, 6, seeded("prompt tiles", "options"))
    out = native_attention(inputs, scale, **kwargs)
    assert_matches_dense(inputs, out, scale, **kwargs)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("options", ATTENTION_OPTIONS.values(), ids=ATTENTION_OPTIONS.keys())
@pytest.mark.parametrize("case", ["mixed", "extend", "many-decodes"])
def test_native_options_match_dense(case, options, heads):
    """ALiBi, sliding window, soft-cap and sinks, alone and together; windows shorter than
    the context, so whole blocks and parts of blocks drop out."""
    inputs = case_inputs(case, heads, 16, 4, stale="nan")
    kwargs = option_kwargs(options, heads[0], seeded(case, "options"))
    assert_matches_dense(inputs, native_attention(inputs, 0.3, **kwargs), 0.3, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 9], ids=["causal", "window"])
@pytest.mark.parametrize("case", ["mixed", "extend", "many-decodes"])
def test_sinks_match_the_reference(case, window, dtype):
    """cpu.paged_attention with sinks against the torch reference (float32 on the same
    rounded data): decode tiles and wide prompt tiles, GQA, with and without a window;
    and the sinks change the output."""
    inputs = case_inputs(case, (9, 3), 64, 16, dtype=dtype)
    sinks = sink_test_logits(9, seeded(case, "sinks"))
    options = {"sliding_window": window}
    out = cpu.paged_attention(
        inputs.query, inputs.key_cache, inputs.value_cache, inputs.meta, 0.125,
        sinks=sinks, **options,
    )  # fmt: skip
    expected = reference.paged_attention(
        inputs.query.float(), inputs.key_cache.float(), inputs.value_cache.float(),
        inputs.meta, 0.125, sinks=sinks, **options,
    )  # fmt: skip
    assert out.dtype == dtype
    assert rel_err(out, expected) < TOLERANCE[dtype]
    without = native_attention(inputs, 0.125, **options)
    assert rel_err(without, expected) > 10 * TOLERANCE[dtype]


# (query dtype, cache dtype): 16-bit queries over their own caches, and caches narrower
# than the query (--kv-cache-dtype: 16 bits under float32, fp8 under any).
NARROW_CACHES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float32, torch.float8_e4m3fn),
    (torch.float32, torch.float8_e5m2),
    (torch.bfloat16, torch.float8_e4m3fn),
    (torch.float16, torch.float8_e5m2),
]


@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize(("dtype", "cache_dtype"), NARROW_CACHES, ids=str)
@pytest.mark.parametrize("case", ["mixed", "prefill"])
def test_narrow_queries_and_caches_compute_in_float32(case, dtype, cache_dtype, head_dim):
    """Decode and prompt tiles widen each query and cache row as they read it and compute in
    float32, so the output is attention over the rounded data, as the reference computes it
    in float32."""
    wide = case_inputs(case, (9, 3), head_dim, 16)
    narrow = dataclasses.replace(
        wide,
        query=wide.query.to(dtype),
        key_cache=wide.key_cache.to(cache_dtype),
        value_cache=wide.value_cache.to(cache_dtype),
    )
    out = native_attention(narrow, 0.125)
    assert out.dtype == dtype
    expected = reference.paged_attention(
        narrow.query.float(),
        narrow.key_cache.float(),
        narrow.value_cache.float(),
        wide.meta,
        0.125,
    )
    assert rel_err(out, expected) < TOLERANCE[dtype]
    # and the rounding is the cache's: float32 K/V give a measurably different answer
    assert rel_err(out.float(), native_attention(wide, 0.125)) > TOLERANCE[torch.float32]


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_value_of_a_narrow_cache_reads_as_torch_widens_it(cache_dtype):
    """Each bit pattern of the format (subnormals, infinities, NaN included) as one value
    element: a sequence of a single key attends to it with weight 1, so the output is the
    value row as the kernel widened it, to compare with torch's own conversion."""
    bits = torch.arange(1 << (8 * cache_dtype.itemsize), dtype=torch.int32)
    as_int = torch.int16 if cache_dtype.itemsize == 2 else torch.uint8
    values = bits.to(as_int).view(cache_dtype).view(-1, 1, 1, 256)  # [seqs, 1 slot, 1 head, D]
    num_seqs = values.shape[0]
    keys = torch.zeros(values.shape, dtype=cache_dtype)
    out = torch.full((num_seqs, 1, 256), float("nan"))
    torch.ops.serve_cpu.paged_attention(
        out,
        torch.randn(num_seqs, 1, 256),
        keys,
        values,
        torch.arange(num_seqs).view(-1, 1),  # sequence i: block i
        torch.ones(num_seqs, dtype=torch.int64),
        torch.arange(num_seqs + 1),
        1.0,
        None,
        0,
        0.0,
    )
    torch.testing.assert_close(
        out, values.view(num_seqs, 1, 256).float(), rtol=0, atol=0, equal_nan=True
    )


def test_a_cache_wider_than_the_query_is_refused():
    inputs = case_inputs("decode", (4, 2), 32, 4, dtype=torch.bfloat16)
    wide = dataclasses.replace(
        inputs, key_cache=inputs.key_cache.float(), value_cache=inputs.value_cache.float()
    )
    with pytest.raises(RuntimeError, match="the cache's dtype must be the query's"):
        native_attention(wide, 0.125)


def test_long_contexts_and_large_scores_stay_exact():
    """Contexts of hundreds of blocks, scores in the hundreds (the running max grows block
    after block and the sum is rescaled each time), and a score far below the max."""
    gen = seeded("long")
    inputs = make_attention_inputs(
        [(1500, 1), (700, 1), (300, 20)], 2, (9, 3), 64, 16, gen, stale="nan"
    )
    inputs.query.mul_(8.0)  # scores of order 100: exp underflows for many keys
    assert_matches_dense(inputs, native_attention(inputs, 0.125), 0.125)


def test_threads_give_the_same_bits():
    """Work items are independent, so two threads give exactly one thread's output."""
    inputs = case_inputs("many-decodes", (9, 3), 64, 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_attention(inputs, 0.125)
        torch.set_num_threads(2)
        two = native_attention(inputs, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_one_call_mixes_both_tile_kinds():
    """cpu.paged_attention on decodes, short chunks (a key per lane) and long ones (a query
    per lane, tiles ending mid-tile), in one call and with every option: each row right."""
    inputs = make_attention_inputs(
        [(30, 1), (17, 1), (40, 20), (9, 3), (25, 9), (70, 33), (64, 64)],
        2,
        (9, 3),
        64,
        4,
        seeded("mix"),
        stale="nan",
    )
    sinks = sink_test_logits(9, seeded("mix", "sinks"))
    for options in ({}, {"sliding_window": 7, "logit_softcap": 5.0, "sinks": sinks}):
        out = cpu.paged_attention(
            inputs.query, inputs.key_cache, inputs.value_cache, inputs.meta, 0.125, **options
        )
        assert_matches_dense(inputs, out, 0.125, **options)


def test_turned_off_by_the_environment(monkeypatch, caplog):
    monkeypatch.setenv(native.ENV_VAR, "0")
    native.available.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=native.__name__):
            assert not native.available()
        assert f"{native.ENV_VAR}=0" in caplog.text
    finally:
        native.available.cache_clear()


def test_without_a_compiler_the_reference_runs_and_says_why(monkeypatch, caplog, tmp_path):
    """No cached build for this machine and no compiler to make one."""
    monkeypatch.setattr(native, "build_dir", lambda: tmp_path / "no-build-here")
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    native.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert not native.available()
            inputs = make_attention_inputs([(20, 1), (9, 9)], 1, (4, 2), 16, 4, seeded("ref"))
            out = cpu.paged_attention(
                inputs.query, inputs.key_cache, inputs.value_cache, inputs.meta, 0.3
            )
        assert "no C++ compiler" in caplog.text
        assert_matches_dense(inputs, out, 0.3)
    finally:
        native.available.cache_clear()


def test_a_portable_build_refuses_a_cpu_without_its_instructions(monkeypatch, caplog):
    """A Docker image's x86-64-v3 build on a CPU without AVX2: the reference runs, and the
    log names what the CPU lacks (an illegal instruction would kill the server instead)."""
    monkeypatch.setenv(native.MARCH_ENV_VAR, "x86-64-v3")
    monkeypatch.setattr(native, "_cpu_features", lambda: {"sse4_2", "fma"})
    native.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert not native.available()
        assert "this CPU lacks avx2, bmi2, f16c" in caplog.text
    finally:
        native.available.cache_clear()


def test_a_build_leaves_its_key_alone(monkeypatch, tmp_path):
    """cpp_extension appends torch's flags to the flag lists it is given. Were those the
    module's own, the key would change after a first build: the next lookup (after a
    fallback test clears the cache) would miss, build a second copy and load it beside
    the first, and registering the ops twice aborts the process."""
    from torch.utils import cpp_extension

    def appending_load(**kwargs):
        kwargs["extra_ldflags"].append("-ltorch_cpu")
        kwargs["extra_cflags"].append("-DTORCH_EXTENSION_NAME=x")

    monkeypatch.setattr(cpp_extension, "load", appending_load)
    key = native.build_key()
    native._build(tmp_path)
    assert native.build_key() == key


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(960, 576), (37, 100), (5, 16), (1, 3)])
def test_linear_few_rows_matches_torch(rows, shape):
    """The few-row product against float64 torch, with and without a bias; weight rows
    in groups and leftovers, inner sizes with and without a tail past the vector slices."""
    out_features, in_features = shape
    gen = seeded("linear", rows, shape)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    for b in (None, bias):
        out = torch.full((rows, out_features), float("nan"))
        torch.ops.serve_cpu.linear_few_rows(out, x, weight, b)
        expected = x.double() @ weight.double().t() + (0 if b is None else b.double())
        assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("dtype", "rows", "packed_as"),
    [
        (torch.float32, 1, None),
        (torch.float32, 2, None),  # oneDNN's float32 two-row product is its slowest
        (torch.float32, 3, "panels"),
        (torch.float32, 7, "panels"),
        (torch.float32, 200, "panels"),
        (torch.bfloat16, 1, None),
        (torch.bfloat16, 2, None),
        (torch.bfloat16, 3, "panels where they take bfloat16"),
    ],
)
def test_cpu_linear_matches_torch_on_every_path(dtype, rows, packed_as):
    """A row or two in the few-row kernel, more on the weight packed on first use (float32
    in the native panels, bfloat16 there too where the build has AVX512_BF16, else in
    oneDNN's layout); every path against float64 torch."""
    gen = seeded("cpu-linear", rows)
    x, weight = torch.randn(rows, 300, generator=gen), torch.randn(200, 300, generator=gen)
    bias = torch.randn(200, generator=gen)
    x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    out = cpu.linear(x, weight, bias)
    assert out.dtype == dtype
    rtol, atol = (1e-5, 1e-4) if dtype == torch.float32 else (2 * 2**-8, 1e-2)
    assert torch.allclose(out.double(), expected, rtol=rtol, atol=atol)
    entry = getattr(weight, "_serve_packed", None)
    if packed_as is None:
        assert entry is None
    else:
        assert entry[0].is_mkldnn is not cpu.panels_fit(dtype)


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [
        (3, 960, 576),  # the default model's qkv
        (64, 576, 1536),  # its down_proj at a full decode batch
        (5, 100, 37),  # a last panel of few columns; K under a vector
        (13, 130, 2500),  # K in two blocks (the chain carries on through y)
        (200, 64, 64),
    ],
)
def test_panel_linear_against_float64(rows, out_features, in_features):
    """The panel kernel (float32 weights from three rows) on shapes whose last panel is
    partial and whose K runs past one block, with and without a bias."""
    gen = seeded("panels", rows, out_features, in_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    panels = torch.ops.serve_cpu.pack_panels(weight)
    for b in (None, bias):
        out = torch.full((rows, out_features), float("nan"))
        torch.ops.serve_cpu.linear_panels(out, x, panels, b)
        expected = x.double() @ weight.double().t() + (0 if b is None else b.double())
        assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-4 * in_features**0.5)


needs_bf16_panels = pytest.mark.skipif(
    not cpu.panels_fit(torch.bfloat16), reason="this build's panels take no bfloat16 (AVX512_BF16)"
)


@needs_bf16_panels
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [
        (3, 960, 576),
        (64, 576, 1536),
        (5, 100, 37),  # K odd: the last x pairs with a zero
        (13, 130, 4097),  # K odd and in two blocks: the float32 sums carried between them
        (200, 64, 64),
    ],
)
def test_bfloat16_panel_linear_rounds_once(rows, out_features, in_features):
    """bfloat16 panels sum pairs of products in float32 (`vdpbf16ps`) and round y once: the
    float64 product's bfloat16 rounding, give or take its last bit."""
    gen = seeded("panels-bf16", rows, out_features, in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    panels = torch.ops.serve_cpu.pack_panels(weight)
    for b in (None, bias):
        out = torch.full((rows, out_features), float("nan"), dtype=torch.bfloat16)
        torch.ops.serve_cpu.linear_panels(out, x, panels, b)
        expected = x.double() @ weight.double().t() + (0 if b is None else b.double())
        assert torch.allclose(out.double(), expected, rtol=2 * 2**-8, atol=1e-2)


@needs_bf16_panels
def test_bfloat16_panel_rows_do_not_depend_on_each_other():
    gen = seeded("panel-rows-bf16")
    x = torch.randn(70, 576, generator=gen).bfloat16()
    panels = torch.ops.serve_cpu.pack_panels(torch.randn(576, 576, generator=gen).bfloat16())
    full = torch.empty(70, 576, dtype=torch.bfloat16)
    torch.ops.serve_cpu.linear_panels(full, x, panels, None)
    part = torch.empty(3, 576, dtype=torch.bfloat16)
    torch.ops.serve_cpu.linear_panels(part, x[[69, 3, 3]].contiguous(), panels, None)
    assert torch.equal(part, full[[69, 3, 3]])


def test_panel_linear_rows_do_not_depend_on_each_other():
    """A row's output is the same to the bit alone, among 3 rows or among 70 (tiles, row
    chunks and thread splits all differ): what lets the native stack run a prompt's last
    layer for its sampled rows alone and still return the loop's logits."""
    gen = seeded("panel-rows")
    x = torch.randn(70, 576, generator=gen)
    weight = torch.randn(576, 576, generator=gen)
    panels = torch.ops.serve_cpu.pack_panels(weight)
    full = torch.empty(70, 576)
    torch.ops.serve_cpu.linear_panels(full, x, panels, None)
    for picked in ([69, 3, 3], [0, 1, 2, 3, 4, 5, 6], list(range(17, 40))):
        part = torch.empty(len(picked), 576)
        torch.ops.serve_cpu.linear_panels(part, x[picked].contiguous(), panels, None)
        assert torch.equal(part, full[picked])


def test_panel_linear_refuses_what_it_cannot_run():
    weight = torch.randn(64, 32)
    panels = torch.ops.serve_cpu.pack_panels(weight)
    out = torch.empty(4, 64)
    with pytest.raises(RuntimeError, match="x's K"):
        torch.ops.serve_cpu.linear_panels(out, torch.randn(4, 31), panels, None)
    with pytest.raises(RuntimeError, match="out's N"):
        torch.ops.serve_cpu.linear_panels(torch.empty(4, 500), torch.randn(4, 32), panels, None)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.serve_cpu.pack_panels(weight.half())
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.serve_cpu.linear_panels(out.double(), torch.randn(4, 32), panels, None)


def test_prepacked_weight_follows_in_place_writes():
    gen = seeded("repack")
    x = torch.randn(3, 64, generator=gen)
    weight = torch.nn.Parameter(torch.randn(32, 64, generator=gen), requires_grad=False)
    before = cpu.linear(x, weight)
    with torch.no_grad():
        weight.mul_(2.0)
    assert torch.allclose(cpu.linear(x, weight), 2 * before, rtol=1e-5, atol=1e-5)


def test_prepacking_turned_off_runs_torch(monkeypatch):
    monkeypatch.setenv(cpu.PREPACK_ENV_VAR, "0")
    cpu.prepack_enabled.cache_clear()
    try:
        gen = seeded("no-prepack")
        x, weight = torch.randn(5, 40, generator=gen), torch.randn(24, 40, generator=gen)
        out = cpu.linear(x, weight)
        assert not hasattr(weight, "_serve_packed")
        assert torch.allclose(out, x @ weight.t(), rtol=1e-5, atol=1e-5)
    finally:
        cpu.prepack_enabled.cache_clear()


def test_linear_few_rows_in_bfloat16_rounds_once():
    """bfloat16 weights stream in as bfloat16 and sum in float32; only y is rounded, so the
    result is the float64 product's bfloat16 rounding, give or take its last bit."""
    gen = seeded("linear-bf16")
    x = torch.randn(1, 576, generator=gen).bfloat16()
    weight, bias = torch.randn(100, 576, generator=gen).bfloat16(), torch.randn(100).bfloat16()
    for b in (None, bias):
        out = torch.empty(1, 100, dtype=torch.bfloat16)
        torch.ops.serve_cpu.linear_few_rows(out, x, weight, b)
        exact = x.double() @ weight.double().t() + (0 if b is None else b.double())
        assert out.dtype == torch.bfloat16
        assert torch.allclose(out.double(), exact, rtol=2 * 2**-8, atol=1e-2)
    assert cpu.linear(x, weight).dtype == torch.bfloat16


ROW_SHAPES = [(1, 576), (7, 576), (64, 100), (3, 17)]  # hidden sizes with and without a tail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_rms_norm_matches_torch(shape, dtype):
    """The fused norm against the torch reference, alone and with the residual add: the
    same roundings, so float32 agrees to a few ulps and bfloat16 to its last bit."""
    gen = seeded("rms", shape, dtype)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = torch.randn(shape[1], generator=gen).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-2)
    out = cpu.rms_norm(x, weight, 1e-6)
    assert torch.allclose(out.float(), reference.rms_norm(x, weight, 1e-6).float(), **tol)
    out, total = cpu.rms_norm(x, weight, 1e-6, residual)
    expected_out, expected_total = reference.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(total, expected_total)  # the add rounds exactly as torch's does
    assert torch.allclose(out.float(), expected_out.float(), **tol)
    assert out.dtype == total.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 3072), (9, 34), (64, 2 * 1536)])
def test_silu_and_mul_matches_torch(shape, dtype):
    """Large, small and negative gates (the exp both ways), widths with and without a tail."""
    gen = seeded("silu", shape, dtype)
    x = (6 * torch.randn(shape, generator=gen)).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # past exp's range, and zero
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
    out = cpu.silu_and_mul(x)
    assert out.shape == (shape[0], shape[1] // 2) and out.dtype == dtype
    assert torch.allclose(out.float(), reference.silu_and_mul(x).float(), **tol)


def test_row_kernels_leave_other_layouts_to_torch():
    """Strided views and float16 take the reference path and still give its answer."""
    gen = seeded("row-fallback")
    x = torch.randn(8, 64, generator=gen)[:, ::2]  # not contiguous
    weight = torch.randn(32, generator=gen)
    assert torch.equal(cpu.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    half = torch.randn(4, 32, generator=gen).half()
    assert torch.equal(cpu.silu_and_mul(half), reference.silu_and_mul(half))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
def test_rotary_embedding_matches_torch_bit_for_bit(rotary_dim, neox, dtype):
    """q and k as the strided views of a fused QKV output the models pass; every product
    rounds where torch's ops round it, so the result is torch's to the last bit (greedy
    tokens depend on it)."""
    gen = seeded("rope", rotary_dim, neox, dtype)
    tokens, heads, kv_heads, head_dim = 11, 6, 2, 64
    qkv = (4 * torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cache = make_cos_sin_cache(rotary_dim, 4096, 10000.0)
    q_out, k_out = cpu.rotary_embedding(positions, q, k, cache, neox)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, cache, neox)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert q_out.dtype == dtype and q_out.is_contiguous()
    assert not torch.equal(q_out, q)  # it rotated something


def test_rotary_embedding_rejects_a_position_past_the_cache():
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu.rotary_embedding(torch.tensor([0, 16]), q, k, make_cos_sin_cache(8, 16, 10000.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_the_slots_torch_writes(dtype):
    """Into the heads-first CPU cache, from strided K/V views, with a skipped (-1) slot:
    the same cache contents as the reference, and untouched slots stay as they were."""
    gen = seeded("cache-write", dtype)
    num_blocks, block_size, kv_heads, head_dim, tokens = 6, 4, 2, 16, 9
    kv = torch.randn(tokens, 2 * kv_heads * head_dim, generator=gen).to(dtype)
    key = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = kv[:, kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[3] = -1

    def fresh_caches():
        shape = (kv_heads, num_blocks, block_size, head_dim)
        fill = torch.randn(shape, generator=seeded("cache-fill")).to(dtype)
        return [fill.clone().permute(1, 2, 0, 3) for _ in range(2)]

    ours, theirs = fresh_caches(), fresh_caches()
    cpu.reshape_and_cache(key, value, *ours, slots)
    reference.reshape_and_cache(key, value, *theirs, slots)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    flat_k = ours[0].flatten(0, 1)
    assert torch.equal(flat_k[slots[0]], key[0])
    assert not torch.equal(ours[0], fresh_caches()[0])  # it wrote something


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"), [(d, c) for d, c in NARROW_CACHES if d != c], ids=str
)
def test_reshape_and_cache_rounds_rows_into_a_narrower_cache(dtype, cache_dtype):
    """--kv-cache-dtype: each K/V row rounded to nearest (as `Tensor.to` rounds) into its
    slot, fp8 saturating at its largest finite value (e4m3fn would otherwise make NaN of
    anything past 448); skipped and untouched slots stay as they were."""
    gen = seeded("cache-narrow", dtype, cache_dtype)
    num_blocks, block_size, kv_heads, head_dim, tokens = 5, 4, 2, 24, 7
    kv = torch.randn(tokens, 2 * kv_heads * head_dim, generator=gen) * 3
    kv[0, :2] = torch.tensor([6e4, -6e4])  # past e4m3fn and e5m2 (57,344), within float16
    kv = kv.to(dtype)
    key = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = kv[:, kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[2] = -1
    shape = (kv_heads, num_blocks, block_size, head_dim)
    fill = torch.randn(shape, generator=gen).to(cache_dtype)
    ours = [fill.clone().permute(1, 2, 0, 3) for _ in range(2)]
    theirs = [fill.clone().permute(1, 2, 0, 3) for _ in range(2)]
    cpu.reshape_and_cache(key, value, *ours, slots)
    reference.reshape_and_cache(key, value, *theirs, slots)
    for a, b in zip(ours, theirs):  # bit for bit, as bytes: NaN == NaN
        assert torch.equal(
            a.view(torch.uint8 if a.itemsize == 1 else torch.int16),
            b.view(torch.uint8 if b.itemsize == 1 else torch.int16),
        )
    first = ours[0].flatten(0, 1)[slots[0], 0, :2].float()
    if cache_dtype.itemsize == 1:
        limit = torch.finfo(cache_dtype).max
        assert first.tolist() == [limit, -limit]  # saturated, not NaN
    assert torch.equal(ours[1].flatten(0, 1)[slots[1]].float(), value[1].to(cache_dtype).float())
    assert not torch.equal(ours[1].flatten(0, 1)[slots[1]].float(), value[1].float())  # rounded


def test_reshape_and_cache_rejects_a_slot_past_the_cache():
    key = torch.randn(1, 1, 8)
    caches = [torch.zeros(2, 4, 1, 8) for _ in range(2)]
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu.reshape_and_cache(key, key, *caches, torch.tensor([8]))


@pytest.mark.parametrize("n", [1, 7, 16, 17, 100, 49152, 49155])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_argmax_picks_torch_argmax_index(n, rows):
    """Greedy decoding's exactness rests on this: the index torch.argmax gives, ties to the
    first, on fresh random rows and on rows built to trip a vectorised search (the maximum
    repeated across lanes, in the tail, at 0 beside -0, a NaN beside an inf, all -inf)."""
    gen = seeded("argmax", n, rows)
    x = torch.randn(rows, n, generator=gen)
    picks = torch.randint(0, n, (rows, 3), generator=gen)
    for r in range(rows):
        kind = r % 8
        if kind == 1:  # the maximum at three places, in different lanes
            x[r, picks[r]] = 9.0
        elif kind == 2:  # in the tail past the last 16
            x[r, -min(2, n) :] = 9.0
        elif kind == 3:  # a row of zeros and negative zeros: the first wins
            x[r] = 0.0
            x[r, picks[r]] = -0.0
        elif kind == 4:  # NaN is larger than inf
            x[r, picks[r, 0]] = float("inf")
            x[r, picks[r, 1:]] = float("nan")
        elif kind == 5:
            x[r] = float("-inf")
        elif kind == 6:  # +inf twice
            x[r, picks[r, 1:]] = float("inf")
    assert torch.equal(cpu.argmax(x), x.argmax(dim=-1))
    torch.manual_seed(0)
    wide = torch.randn(rows, n) * 1e30
    assert torch.equal(cpu.argmax(wide), wide.argmax(dim=-1))


def test_argmax_leaves_other_layouts_and_dtypes_to_torch():
    x = torch.randn(6, 40, generator=seeded("argmax layouts"))
    for other in (x.t(), x.to(torch.bfloat16), x[:, ::2], x.to(torch.float64)):
        assert torch.equal(cpu.argmax(other), other.argmax(dim=-1))


def _exact_top_p_edge(row: torch.Tensor, top_p: float) -> float:
    """The oracle: the least likely logit of the fewest most likely tokens whose
    probability reaches top_p, by a float64 sort."""
    values = row.double().sort(descending=True).values
    probs = values.softmax(dim=0)
    kept = int(((probs.cumsum(0) - probs) < top_p).sum())
    return float(values[max(kept, 1) - 1])


@pytest.mark.parametrize("n", [1, 7, 100, 5000, 49155])
def test_top_p_cut_finds_the_nucleus_edge(n):
    """Each row's top-p edge as a float64 sort finds it, on fresh random rows: flat and
    peaked, ties at and around the edge, masked (-inf) tokens, one unmasked token, every
    logit equal, top_p from tiny to 1; the reference (float32 masses) agrees but where a
    mass lands within rounding of top_p."""
    gen = seeded("top_p_cut", n)
    rows = 24
    x = torch.randn(rows, n, generator=gen) * torch.tensor([0.05, 0.5, 2.0, 8.0]).repeat(6)[:, None]
    top_p = torch.rand(rows, generator=gen) * 0.999 + 0.0005
    top_p[:3] = torch.tensor([1.0, 1e-4, 0.5])
    picks = torch.randint(0, n, (rows, 4), generator=gen)
    for r in range(rows):
        kind = r % 6
        if kind == 1:  # the same logit at four places
            x[r, picks[r]] = x[r].max() - 0.1
        elif kind == 2:  # most tokens masked
            x[r, torch.rand(n, generator=gen) < 0.9] = float("-inf")
            x[r, picks[r, 0]] = 0.0
        elif kind == 3 and r > 12:  # one token left
            x[r] = float("-inf")
            x[r, picks[r, 0]] = 1.0
        elif kind == 4 and r > 12:  # every logit the same
            x[r] = 0.25
    cut = cpu.top_p_cut(x, top_p)
    assert cut.shape == (rows, 1)
    expected = [_exact_top_p_edge(x[r], float(top_p[r])) for r in range(rows)]
    assert cut.flatten().tolist() == expected
    same = reference.top_p_cut(x, top_p).flatten() == cut.flatten()
    assert int(same.sum()) >= rows - 2
