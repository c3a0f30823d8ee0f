"""The Triton quantized linear layer against `reference.quantized_linear`, on fresh random
packed weights (Triton's interpreter on CPU; the `gpu` test at real shapes on CUDA).

Codes span every value of their kind (fp8: every byte but the two NaNs, so subnormals and
both zeros too; fp4: all 16 E2M1 nibbles), scales and zero points are random per (output,
group) (fp4: MXFP4's, powers of two from E8M0 exponents and no zero points), and odd
in_features leave garbage in the last byte's padding nibble, which must not be read.
Act order's weights sorted by group at load (`input_perm`) run the grouped path on x
gathered into their order, against the reference, which multiplies x as it is by the
weight dequantized back in the checkpoint's order.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import TOLERANCE, rel_err

from serve.kernels import reference
from serve.kernels.packed_weight import (
    FP4_VALUES,
    PackedWeight,
    mxfp4_weight,
    pack_uint4,
    sort_inputs_by_group,
)


@pytest.fixture(scope="module")
def triton_ops():
    from serve.kernels import triton as ops

    return ops


def make_packed_weight(
    kind: str,
    out_features: int,
    in_features: int,
    group_size: int | None,  # None: one group (per-channel scales)
    gen: torch.Generator,
    *,
    g_idx: bool | str = False,  # "sorted": act order, its inputs sorted by group
    zeros: bool = True,
    device: torch.device | str = "cpu",
) -> PackedWeight:
    """Built on the CPU from `gen` (reproducible whatever the device), then moved."""
    shape = (out_features, in_features)
    if kind in ("uint4", "fp4"):
        codes = pack_uint4(torch.randint(0, 16, shape, generator=gen))
        if in_features % 2:
            codes[:, -1] |= 0xA0  # padding nibble: reading it as input in_features is wrong
        max_code = 15.0 if kind == "uint4" else 6.0
    elif kind == "uint8":
        codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        max_code = 255.0
    elif kind == "fp8":
        bits = torch.randint(0, 254, shape, generator=gen, dtype=torch.uint8)
        bits = bits + (bits >= 0x7F).to(torch.uint8)  # skip 0x7F and 0xFF, e4m3fn's NaNs
        codes = bits.view(torch.float8_e4m3fn)
        max_code = 16.0
    else:
        raise ValueError(kind)
    if group_size is None:
        group_size, num_groups = in_features, 1
    else:
        num_groups = -(-in_features // group_size)
    groups_shape = (out_features, num_groups)
    # Signed, never zero: a scale of 0 would hide a wrong code or group.
    signs = torch.randint(0, 2, groups_shape, generator=gen) * 2 - 1
    scales = (0.5 + torch.rand(groups_shape, generator=gen)) * signs / max_code
    zero_points = torch.rand(groups_shape, generator=gen) * max_code if zeros else None
    if kind == "fp4":  # MXFP4's: E8M0 exponents around checkpoints' 120..130, no zeros
        exponents = torch.randint(120, 131, groups_shape, generator=gen) - 127
        scales, zero_points = torch.ldexp(torch.ones(groups_shape), exponents), None
    groups = None
    if g_idx:  # GPTQ's act order: each group's inputs scattered across the row
        perm = torch.randperm(in_features, generator=gen)
        groups = (torch.arange(in_features) // group_size)[perm]
    weight = PackedWeight(kind, codes, scales, zero_points, group_size, in_features, groups)
    if g_idx == "sorted":
        weight = sort_inputs_by_group(weight)
        assert weight.input_perm is not None  # its groups are whole
    return to_device(weight, device)


def to_device(weight: PackedWeight, device: torch.device | str) -> PackedWeight:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return PackedWeight(
        weight.kind,
        move(weight.codes),
        move(weight.scales),
        move(weight.zeros),
        weight.group_size,
        weight.in_features,
        move(weight.g_idx),
        move(weight.input_perm),
    )


def _tiny_tiles():
    from serve.kernels.triton.quantized_linear import QuantizedLinearTiles

    # 16-wide tiles: out 32 is two N tiles, in 40 three K steps with a ragged last one.
    return QuantizedLinearTiles(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)


# name: (group_size, g_idx, zero points)
GROUPINGS = {
    "group16": (16, False, True),  # one group per K step: a scale per output
    "group12": (12, False, True),  # groups straddle K steps: a scale per code
    "g_idx": (16, True, True),
    "act-order-sorted": (16, "sorted", True),  # one group per K step, x gathered
    "per-channel-symmetric": (None, False, False),
}
# (rows, in_features, bias)
SHAPES = {"decode-bias": (1, 40, True), "rows5-odd": (5, 39, False), "rows5-ragged": (5, 37, True)}
KINDS = ["uint4", "uint8", "fp8", "fp8-bits", "fp4"]  # fp8-bits: decoded from uint8 (pre-sm_89)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("grouping", GROUPINGS.values(), ids=GROUPINGS.keys())
@pytest.mark.parametrize("kind", KINDS)
def test_triton_matches_reference(triton_ops, device, kind, grouping, shape):
    from serve.kernels.triton.quantized_linear import quantized_linear

    rows, in_features, with_bias = shape
    group_size, g_idx, zeros = grouping
    gen = torch.Generator().manual_seed(1000 * rows + in_features + KINDS.index(kind))
    weight = make_packed_weight(
        kind.removesuffix("-bits"), 32, in_features, group_size, gen, g_idx=g_idx, zeros=zeros
    )
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(32, generator=gen) if with_bias else None
    expected = reference.quantized_linear(x, weight, bias)
    weight, x = to_device(weight, device), x.to(device)
    bias = None if bias is None else bias.to(device)
    out = quantized_linear(
        x, weight, bias, tiles=_tiny_tiles(), fp8_native=False if kind == "fp8-bits" else None
    )
    assert out.shape == (rows, 32) and out.dtype == x.dtype
    assert rel_err(out, expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["uint4", "uint4-group16", "fp8", "fp4"])
def test_default_tiles_half_precision(triton_ops, device, kind, dtype):
    """The op as the layers call it (tiles chosen by the row count), 20 rows in one 32-row
    tile, x and bias in the model dtype. Groups of 16 inputs (uint4: act order's,
    or plain ones in uint4-group16): a K step of one group would be 16 inputs, which Triton
    3.6 miscompiles for nibble codes in a 16-bit dot (quantized_linear's docstring)."""
    gen = torch.Generator().manual_seed(20)
    weight = make_packed_weight(
        kind.removesuffix("-group16"), 48, 72, 16, gen, g_idx=kind == "uint4"
    )
    x = torch.randn(20, 72, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    expected = reference.quantized_linear(x.float(), weight, bias.float())
    weight = to_device(weight, device)
    out = triton_ops.quantized_linear(x.to(device), weight, bias.to(device))
    assert out.dtype == dtype
    assert rel_err(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("fp8_native", [True, False], ids=["native", "bits"])
def test_every_fp8_code(triton_ops, device, fp8_native):
    """All 256 float8_e4m3fn bytes through the kernel with unit scales and x = I, so y is
    w.T exactly. The two NaN bytes share output 15, whose column is all NaN (0 * NaN)
    where the conversion is the hardware's or serve's own."""
    from serve.kernels.triton.quantized_linear import quantized_linear

    bits = torch.arange(256, dtype=torch.int32)
    bits[0x7F], bits[0xF0] = 0xF0, 0x7F  # 0xFF is in output 15 already
    codes = bits.to(torch.uint8).view(16, 16).view(torch.float8_e4m3fn)
    weight = PackedWeight("fp8", codes, torch.ones(16, 1), None, 16, 16)
    out = quantized_linear(
        torch.eye(16, device=device),
        to_device(weight, device),
        tiles=_tiny_tiles(),
        fp8_native=fp8_native,
    ).cpu()
    expected = codes.float().T
    # Triton's interpreter casts e4m3fn's NaN bytes as if they were +-480; hardware doesn't.
    if not (fp8_native and device.type == "cpu"):
        assert out[:, 15].isnan().all()
    assert torch.equal(out[:, :15], expected[:, :15])


def test_every_fp4_code(triton_ops, device):
    """All 16 E2M1 nibbles, each at even and odd inputs (code (o + i) % 16), with unit
    scales and x = I: y is w.T exactly, FP4_VALUES' values."""
    from serve.kernels.triton.quantized_linear import quantized_linear

    nibbles = (torch.arange(16)[:, None] + torch.arange(16)) % 16  # [out, in]
    weight = PackedWeight("fp4", pack_uint4(nibbles), torch.ones(16, 1), None, 16, 16)
    out = quantized_linear(torch.eye(16, device=device), to_device(weight, device))
    assert torch.equal(out.cpu(), torch.tensor(FP4_VALUES)[nibbles].T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 20])
def test_mxfp4_default_tiles(triton_ops, device, rows, dtype):
    """An MXFP4 weight as GPT-OSS stores it (`mxfp4_weight`: groups of 32, E8M0 scales),
    through the op with the tiles it chooses (a K step of one group for bfloat16)."""
    gen = torch.Generator().manual_seed(rows)
    blocks = torch.randint(0, 256, (48, 3, 16), generator=gen).to(torch.uint8)  # 96 inputs
    scales = torch.randint(120, 131, (48, 3), generator=gen).to(torch.uint8)
    weight = mxfp4_weight(blocks, scales)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    expected = reference.quantized_linear(x.float(), weight, bias.float())
    out = triton_ops.quantized_linear(x.to(device), to_device(weight, device), bias.to(device))
    assert out.dtype == dtype
    assert rel_err(out, expected) < TOLERANCE[dtype]


def test_tiles_follow_rows_and_groups(triton_ops):
    """Decode and prefill tiles; a power-of-two group smaller than BLOCK_K becomes BLOCK_K,
    so each K step needs one scale per output (not with act order, nor a 12-input group)."""
    from serve.kernels.triton.quantized_linear import choose_quantized_linear_tiles as choose

    gen = torch.Generator().manual_seed(2)

    def weight(group_size: int, g_idx: bool = False) -> PackedWeight:
        return make_packed_weight("uint4", 16, 96, group_size, gen, g_idx=g_idx)

    bf16 = torch.bfloat16
    assert choose(1, bf16, weight(128)).block_m == 16
    assert choose(1, bf16, weight(128)).block_k == 128
    assert choose(4096, bf16, weight(128)).block_m == 128
    assert choose(1, bf16, weight(32)).block_k == 32
    assert choose(1, bf16, weight(32, g_idx=True)).block_k == 128
    assert choose(1, bf16, weight(12)).block_k == 128


@pytest.mark.parametrize("kind", ["uint4", "fp4", "uint8", "fp8"])
def test_nibble_codes_in_half_precision_step_at_least_32_inputs(triton_ops, kind):
    """Nibble codes against float16/bfloat16 x never get a 16-input K step, not from a
    16-input group nor from tiles given: Triton 3.6 lowers that dot wrong on the GPU (the
    module docstring). 8-bit codes, and float32 x (no mma.sync), keep the one-group step."""
    from serve.kernels.triton.quantized_linear import QuantizedLinearTiles, quantized_linear
    from serve.kernels.triton.quantized_linear import choose_quantized_linear_tiles as choose

    gen = torch.Generator().manual_seed(5)
    weight = make_packed_weight(kind, 16, 64, 16, gen, zeros=kind != "fp4")
    nibbles = kind in ("uint4", "fp4")
    for dtype in (torch.bfloat16, torch.float16):
        for rows in (1, 20, 40, 300):
            tiles = choose(rows, dtype, weight)
            assert tiles.block_k >= 32 if nibbles else tiles.block_k == 16, (dtype, rows, tiles)
    assert choose(20, torch.float32, weight).block_k == 16
    tiles = QuantizedLinearTiles(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
    x = torch.randn(2, 64, generator=gen)
    for dtype in (torch.bfloat16, torch.float16):
        if nibbles:
            with pytest.raises(ValueError, match="block_k 16"):
                quantized_linear(x.to(dtype), weight, tiles=tiles)
        else:
            assert quantized_linear(x.to(dtype), weight, tiles=tiles).shape == (2, 16)
    assert quantized_linear(x, weight, tiles=tiles).shape == (2, 16)


def test_leading_dims_and_no_rows(triton_ops, device):
    gen = torch.Generator().manual_seed(3)
    weight = make_packed_weight("uint8", 16, 24, 8, gen)
    x = torch.randn(2, 3, 24, generator=gen)
    expected = reference.quantized_linear(x, weight)
    weight = to_device(weight, device)
    out = triton_ops.quantized_linear(x.to(device), weight)
    assert out.shape == (2, 3, 16)
    assert rel_err(out, expected) < TOLERANCE[torch.float32]
    assert triton_ops.quantized_linear(torch.empty(0, 24, device=device), weight).shape == (0, 16)


def test_rejects_mismatched_shapes(triton_ops):
    gen = torch.Generator().manual_seed(4)
    weight = make_packed_weight("uint4", 16, 24, 8, gen)
    with pytest.raises(ValueError, match="quantized_linear"):
        triton_ops.quantized_linear(torch.randn(2, 23), weight)
    with pytest.raises(ValueError, match="bias"):
        triton_ops.quantized_linear(torch.randn(2, 24), weight, torch.randn(15))


# (rows, out_features, in_features): decode, a decode batch, a prefill; Llama-3-8B's qkv
# and down projections, and a ragged layer whose in_features ends mid-group.
GPU_SHAPES = [(1, 6144, 4096), (16, 6144, 4096), (300, 4096, 14336), (37, 700, 1000)]
GPU_WEIGHTS = {
    "uint4-g128": ("uint4", 128, False, True),
    "uint4-g128-act-order": ("uint4", 128, True, True),
    "uint4-g128-act-order-sorted": ("uint4", 128, "sorted", True),
    "uint8-per-channel": ("uint8", None, False, False),
    "fp8-per-channel": ("fp8", None, False, False),
    "fp8-g128-bits": ("fp8", 128, False, False),  # the pre-sm_89 decoding path
    "fp4-g32": ("fp4", 32, False, False),  # MXFP4's
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", GPU_WEIGHTS.values(), ids=GPU_WEIGHTS.keys())
def test_gpu_realistic_bf16(triton_ops, case, shape):
    from serve.kernels.triton.quantized_linear import quantized_linear

    kind, group_size, g_idx, zeros = case
    rows, out_features, in_features = shape
    gen = torch.Generator().manual_seed(rows + in_features)
    cuda = torch.device("cuda")
    weight = make_packed_weight(
        kind, out_features, in_features, group_size, gen, g_idx=g_idx, zeros=zeros, device=cuda
    )
    x = torch.randn(rows, in_features, generator=gen).to(device=cuda, dtype=torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(device=cuda, dtype=torch.bfloat16)
    fp8_native = False if kind == "fp8" and group_size is not None else None
    out = quantized_linear(x, weight, bias, fp8_native=fp8_native)
    expected = reference.quantized_linear(x, weight, bias)
    assert out.dtype == torch.bfloat16
    err = rel_err(out, expected)
    assert err < TOLERANCE[torch.bfloat16], err
