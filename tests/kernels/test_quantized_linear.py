"""The native CPU quantized linear (serve/kernels/cpu/csrc/quantized_linear.cpp) against
`reference.quantized_linear`, on fresh random packed weights.

Codes span every value of their kind (fp8: every byte but the two NaNs, so subnormals and
both zeros too; fp4: all 16 E2M1 nibbles); scales are signed, 0.01 to 0.1 in size, and zero
points random, per (output, group), but fp4's, which are MXFP4's: powers of two from E8M0
exponents, no zero points. Odd in_features leave garbage in the last byte's padding
nibble, which must not be read as an input. Outputs start as NaN, so an output the kernel
skips shows. MXFP4 as GPT-OSS stores it (`mxfp4_weight`) is checked against transformers'
own dequantization.

The kernel has two paths, chosen by the number of rows: up to four rows stream the codes,
more multiply tiles of the dequantized weight (6 and 37 rows: register tiles of four rows
and the rows left over; bfloat16 tiles where the CPU has AVX512_BF16). Within each, groups
of a multiple of 32 inputs decode runs of 32 codes, and act order or other group sizes
look each input's group up; all are covered, with the last group short. Act order's
weights sorted by group at load (`input_perm`) run the grouped paths through
`cpu.quantized_linear`, which gathers x's columns into the stored order.

Each vector width has code of its own (AVX-512's 16 floats, AVX2's 8), so on an AVX-512
machine these tests run a second time, in a process of their own, on the x86-64-v3 build
(AVX2 without AVX-512: the Docker images' and the CI machine's kind).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from dataclasses import replace

import pytest
import torch
from kernel_cases import TOLERANCE, rel_err

from serve.kernels import cpu, reference
from serve.kernels.cpu import native
from serve.kernels.packed_weight import (
    FP4_VALUES,
    PackedWeight,
    mxfp4_weight,
    pack_uint4,
    sort_inputs_by_group,
)

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ toolchain to build with")
PORTABLE_MARCH = "x86-64-v3"


def seeded(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def make_weight(
    kind: str,
    out_features: int,
    in_features: int,
    group_size: int | None,  # None: one group over all inputs
    gen: torch.Generator,
    *,
    g_idx: bool = False,
    zeros: bool = True,
) -> PackedWeight:
    shape = (out_features, in_features)
    if kind in ("uint4", "fp4"):
        codes = pack_uint4(torch.randint(0, 16, shape, generator=gen))
        if in_features % 2:
            codes[:, -1] |= 0xA0  # the padding nibble: read as an input, it shows
        max_code = 15 if kind == "uint4" else 0
    elif kind == "uint8":
        codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        max_code = 255
    else:
        bits = torch.randint(0, 254, shape, generator=gen, dtype=torch.uint8)
        codes = (bits + (bits >= 0x7F).to(torch.uint8)).view(torch.float8_e4m3fn)  # no NaN
        max_code = 0
    if group_size is None:
        group_size = in_features
    num_groups = -(-in_features // group_size)
    groups_shape = (out_features, num_groups)
    signs = torch.randint(0, 2, groups_shape, generator=gen) * 2.0 - 1.0
    scales = (0.01 + 0.09 * torch.rand(groups_shape, generator=gen)) * signs
    if kind == "fp4":  # E8M0's: 2^(e - 127), e around MXFP4 checkpoints' 120..130
        exponents = random_e8m0(groups_shape, gen).int() - 127
        scales = torch.ldexp(torch.ones(groups_shape), exponents)
    zero_points = None
    if zeros and max_code:
        zero_points = torch.rand(groups_shape, generator=gen) * max_code
    groups = None
    if g_idx:  # GPTQ's act order: each group's inputs scattered over the row
        perm = torch.randperm(in_features, generator=gen)
        groups = (torch.arange(in_features) // group_size)[perm]
    return PackedWeight(kind, codes, scales, zero_points, group_size, in_features, groups)


def random_e8m0(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(120, 131, shape, generator=gen, dtype=torch.uint8)


def native_op(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    out = torch.full((x.shape[0], weight.out_features), float("nan"), dtype=x.dtype)
    torch.ops.serve_cpu.quantized_linear(
        out,
        x,
        weight.codes,
        weight.scales,
        weight.zeros,
        weight.g_idx,
        weight.kind,
        weight.group_size,
        bias,
    )
    return out


def check(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor
) -> None:
    """Against the float32 reference (bfloat16 x and bias are exact in float32): float32
    agrees but for the order of the sums; bfloat16 is rounded once at the end, and its
    tiles' weights too where the CPU has AVX512_BF16, as the reference rounds them."""
    expected = reference.quantized_linear(x.float(), weight, None if bias is None else bias.float())
    assert out.dtype == x.dtype
    err = rel_err(out, expected)
    assert err < TOLERANCE[x.dtype], err


# name: (group_size, g_idx, zero points), for 131 inputs (odd; 4 groups of 32 and 3 more)
GROUPINGS = {
    "group32": (32, False, True),  # decoded in runs of 32, one run per group
    "group64": (64, False, True),  # two runs per group; the last group 3 inputs
    "group12": (12, False, True),  # not a multiple of 32: each input looks its group up
    "group6": (6, False, True),  # 22 groups: more than one register of scales to look up
    "g_idx": (32, True, True),
    "per-channel-symmetric": (None, False, False),
}
# (rows, bias)
ROWS = {
    "rows1-bias": (1, True),
    "rows2": (2, False),
    "rows3": (3, False),
    "rows4-bias": (4, True),
    "rows6-bias": (6, True),
    "rows37": (37, False),
}
KINDS = ["uint4", "uint8", "fp8", "fp4"]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("rows", ROWS.values(), ids=ROWS.keys())
@pytest.mark.parametrize("grouping", GROUPINGS.values(), ids=GROUPINGS.keys())
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(kind, grouping, rows, dtype):
    """45 outputs: blocks of four outputs and one left over, on both paths."""
    group_size, g_idx, zeros = grouping
    num_rows, with_bias = rows
    gen = seeded("small", kind, grouping, rows, str(dtype))
    weight = make_weight(kind, 45, 131, group_size, gen, g_idx=g_idx, zeros=zeros)
    x = torch.randn(num_rows, 131, generator=gen).to(dtype)
    bias = torch.randn(45, generator=gen).to(dtype) if with_bias else None
    check(x, weight, bias, native_op(x, weight, bias))


@pytest.mark.parametrize("g_idx", [False, True], ids=["groups", "g_idx"])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("kind", KINDS)
def test_long_rows_on_two_threads(kind, rows, g_idx):
    """4201 inputs: three blocks of the tiles' inputs (2048, 2048, 105), the last group of
    128 short, 33 groups (act order fetches their scales by gathers); 100 outputs, split
    between two threads on both paths."""
    gen = seeded("long", kind, rows, g_idx)
    weight = make_weight(kind, 100, 4201, 128, gen, g_idx=g_idx)
    x = torch.randn(rows, 4201, generator=gen)
    bias = torch.randn(100, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = native_op(x, weight, bias)
    finally:
        torch.set_num_threads(threads)
    check(x, weight, bias, out)


@pytest.mark.parametrize("rows", [1, 6, 37])
@pytest.mark.parametrize("kind", KINDS)
def test_act_order_sorted_by_group_matches_reference(monkeypatch, kind, rows):
    """An act-order weight (groups of 32 over 131 inputs, the last short) with its inputs
    sorted by group: stored in input_perm's order with no g_idx, it dequantizes to the same
    weight, and the native kernel's grouped path (not the reference) on x gathered gives
    the reference's y on the weight as the checkpoint holds it."""
    gen = seeded("sorted", kind, rows)
    act_order = make_weight(kind, 45, 131, 32, gen, g_idx=True)
    weight = sort_inputs_by_group(act_order)
    assert weight.g_idx is None
    assert torch.equal(act_order.g_idx[weight.input_perm], torch.arange(131) // 32)
    f32 = torch.float32
    assert torch.equal(reference.dequantize(weight, f32), reference.dequantize(act_order, f32))
    x = torch.randn(rows, 131, generator=gen)
    bias = torch.randn(45, generator=gen)
    with monkeypatch.context() as patch:
        patch.setattr(cpu.reference, "quantized_linear", None)  # the native kernel only
        out = cpu.quantized_linear(x, weight, bias)
    check(x, act_order, bias, out)


def test_uneven_groups_keep_their_lookup():
    """A tensor-parallel rank's half of a row-parallel act-order layer holds part of each
    group, and a weight whose scales name groups no input is in is not in order either:
    both keep g_idx, unchanged."""
    gen = seeded("uneven")
    whole = make_weight("uint4", 8, 64, 16, gen, g_idx=True)  # 4 groups
    half = replace(whole, codes=whole.codes[:, :16], in_features=32, g_idx=whole.g_idx[:32])
    assert sort_inputs_by_group(half) is half
    in_order = torch.arange(32) // 16  # groups 0 and 1 only, of the scales' 4
    two_of_four = replace(half, g_idx=in_order[torch.randperm(32, generator=gen)])
    assert sort_inputs_by_group(two_of_four) is two_of_four
    with pytest.raises(ValueError, match="not both"):
        replace(two_of_four, input_perm=torch.arange(32))


def identity_products(weight: PackedWeight, rows: int) -> torch.Tensor:
    """y for x the identity's rows, three times over, `rows` of them a call (up to four
    stream the codes, more take the tiles): the weight's transpose, three times over."""
    x = torch.eye(weight.in_features).repeat(3, 1)
    return torch.cat([native_op(x[i : i + rows], weight) for i in range(0, len(x), rows)])


# Inputs of the exact tests: 16, decoded one at a time; 32, a run that the build's
# instruction set decodes in vectors.
EXACT_INPUTS = [16, 32]


@pytest.mark.parametrize("in_features", EXACT_INPUTS)
@pytest.mark.parametrize("rows", [1, 4, 48])
def test_every_fp8_code(rows, in_features):
    """All 256 float8_e4m3fn bytes with unit scales: y is w.T exactly. The NaN bytes
    (0x7F, 0xFF) share the last output, whose column is all NaN."""
    bits = torch.arange(256, dtype=torch.int32)
    bits[0x7F], bits[256 - in_features] = 256 - in_features, 0x7F
    codes = bits.to(torch.uint8).view(-1, in_features).view(torch.float8_e4m3fn)
    n = codes.shape[0]
    weight = PackedWeight("fp8", codes, torch.ones(n, 1), None, in_features, in_features)
    out = identity_products(weight, rows)
    expected = codes.float().T.repeat(3, 1)
    assert out[:, n - 1].isnan().all()
    assert torch.equal(out[:, : n - 1], expected[:, : n - 1])


@pytest.mark.parametrize("in_features", EXACT_INPUTS)
@pytest.mark.parametrize("rows", [1, 4, 48])
def test_every_fp4_code(rows, in_features):
    """All 16 E2M1 nibbles, each at even and odd inputs (code (o + i) % 16), with scales of
    +-1 (AVX2 flips the sign of a scaled magnitude): y is w.T exactly, FP4_VALUES' values,
    on both paths."""
    nibbles = (torch.arange(16)[:, None] + torch.arange(in_features)) % 16  # [out, in]
    scales = torch.tensor([1.0, -1.0]).repeat(8)[:, None]
    weight = PackedWeight("fp4", pack_uint4(nibbles), scales, None, in_features, in_features)
    expected = (torch.tensor(FP4_VALUES)[nibbles] * scales).T.repeat(3, 1)
    assert torch.equal(identity_products(weight, rows), expected)


def test_mxfp4_weight_matches_transformers():
    """GPT-OSS's experts as stored (`*_blocks` [experts, out, in / 32, 16], `*_scales`
    [experts, out, in / 32]): each expert's `mxfp4_weight`, dequantized, is transformers'
    own conversion (which returns [experts, in, out]), exactly, in float32 and bfloat16."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    gen = seeded("mxfp4")
    experts, out_features, num_groups = 3, 24, 5
    blocks = torch.randint(0, 256, (experts, out_features, num_groups, 16), generator=gen)
    blocks = blocks.to(torch.uint8)
    scales = random_e8m0((experts, out_features, num_groups), gen)
    for dtype in (torch.float32, torch.bfloat16):
        expected = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert expected.shape == (experts, num_groups * 32, out_features)
        for e in range(experts):
            weight = mxfp4_weight(blocks[e], scales[e])
            assert weight.kind == "fp4" and weight.in_features == num_groups * 32
            assert torch.equal(reference.dequantize(weight, dtype), expected[e].T)
    assert FP4_VALUES == tuple(mxfp4.FP4_VALUES)


def test_cpu_op_runs_native_where_it_fits(monkeypatch):
    """`cpu.quantized_linear` takes the native kernel for float32 and bfloat16 x of any
    leading shape, and the reference for the rest (float16 x here)."""
    gen = seeded("dispatch")
    weight = make_weight("uint4", 24, 40, 16, gen)
    x = torch.randn(2, 3, 40, generator=gen)
    bias = torch.randn(24, generator=gen)
    expected = reference.quantized_linear(x, weight, bias)
    calls = []
    run_reference = reference.quantized_linear

    def counted(*args):
        calls.append(args)
        return run_reference(*args)

    monkeypatch.setattr(cpu.reference, "quantized_linear", counted)
    out = cpu.quantized_linear(x, weight, bias)
    assert out.shape == (2, 3, 24) and not calls
    assert rel_err(out, expected) < TOLERANCE[torch.float32]
    assert cpu.quantized_linear(torch.empty(0, 40), weight).shape == (0, 24) and not calls
    half = cpu.quantized_linear(x.half(), weight, bias.half())
    assert len(calls) == 1 and half.dtype == torch.float16


def test_rejects_codes_of_the_wrong_shape():
    gen = seeded("shape")
    weight = make_weight("uint4", 8, 40, 8, gen)
    with pytest.raises(RuntimeError, match="codes"):
        native_op(torch.randn(1, 41), weight)  # 41 inputs need 21 bytes a row, not 20


@pytest.mark.skipif(
    native.march() == PORTABLE_MARCH
    or not native.MARCH_FEATURES[PORTABLE_MARCH] <= native._cpu_features()
    or "avx512f" not in native._cpu_features(),
    reason="this process runs the x86-64-v3 build, cannot run it, or its native build is AVX2's",
)
def test_the_portable_build_passes_these_tests():
    """This file's tests and test_cpu_kernels.py's (attention, elementwise, sampling) against
    the x86-64-v3 build, in a process of their own: one process cannot load two builds
    (their ops would register twice). The build is cached as any."""
    env = os.environ | {native.MARCH_ENV_VAR: PORTABLE_MARCH}
    files = [__file__, os.path.join(os.path.dirname(__file__), "test_cpu_kernels.py")]
    command = [sys.executable, "-m", "pytest", *files, "-q", "-x", "-p", "no:cacheprovider"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" in done.stdout  # this test, skipped there
