"""A linear layer over a packed (weight-only quantized) weight: y = x @ w.T + bias, with w
dequantized tile by tile in registers, never whole in memory.

One program computes a BLOCK_M x BLOCK_N tile of y (rows of x by outputs). Its K loop, per
BLOCK_K inputs:

1. loads x's [BLOCK_M, BLOCK_K] slice, and the codes of its outputs for those inputs as a
   [BLOCK_N, BLOCK_K] tile (row-major along K, as stored, so the loads are contiguous);
   `uint4` and `fp4` load BLOCK_K / 2 bytes per output and split each into its two
   nibbles, low nibble first (the even input); an `fp4` nibble is decoded from its E2M1
   bits in registers;
2. dequantizes in float32, `(code - zero) * scale` (packed_weight.py's contract), with
   each input's group from `g_idx` or `k // group_size`; when a block lies inside one
   group (no g_idx, BLOCK_K divides group_size) one scale per output serves the whole tile
   instead of a gather per element (act order's weights sorted by group at load, with
   `input_perm`, take this path: x's columns are gathered into their order first);
3. rounds w to the dot's operand dtype (x's dtype on a GPU: the same rounding as the
   reference's `dequantize(weight, x.dtype)`) and accumulates `tl.dot` in float32.

The bias is added in float32 and y rounded once, to x's dtype, at the store.

`fp8` codes are loaded as float8_e4m3fn and converted where the GPU has that type (Triton
needs sm_89+); elsewhere (A100) the same bytes are loaded as uint8 and decoded with integer
ops, which the tests also run.

`uint4` and `fp4` take a K step of at least 32 inputs when x is float16 or bfloat16
(`min_block_k`). Triton picks the layout of a 16-bit `tl.dot` operand (mma.sync, the
`kWidth` of its dot_op encoding) from the narrowest load behind either operand, halved once
more across a `tl.join` (which `tl.interleave` is): 8-bit codes split into nibbles give
kWidth 8, so each 4-lane quad holds 32 consecutive inputs. Before the fix upstream
(triton-lang/triton#11691, "Fix MMAv2 kWidth for small-K upcast operands"; Triton 3.6
has the bug, 3.9 picks kWidth 4 here), a 16-input step is lowered wrong: the operand loads
read half of x's rows and of the weight's outputs with inputs folded in their place, and
the output is uncorrelated with the right one (rel_err ~1.43 on an H100). 8-bit codes
(kWidth 4) fit a 16-input step.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from serve.kernels.packed_weight import KINDS, NIBBLE_KINDS, PackedWeight, inputs_in_stored_order
from serve.kernels.triton.runtime import dot_operands


@dataclass(frozen=True)
class QuantizedLinearTiles:
    block_m: int  # rows of x per program (tl.dot needs >= 16)
    block_n: int  # outputs per program
    block_k: int  # inputs per K step: a power of two >= min_block_k (nibbles: 2 a byte)
    num_warps: int
    num_stages: int


def choose_quantized_linear_tiles(
    num_rows: int, dtype: torch.dtype, weight: PackedWeight
) -> QuantizedLinearTiles:
    """Starting points, not tuned. Decode (a few rows) is bound by reading the weight: a
    16-row tile (the smallest tl.dot takes) and narrow 32-output tiles, so a 4096-output
    layer still spreads over ~128 programs; prefill fills wider tiles to reuse each
    dequantized weight tile across more rows."""
    if dtype == torch.float32:
        tiles = QuantizedLinearTiles(16 if num_rows <= 16 else 32, 64, 32, 4, 2)
    elif num_rows <= 16:
        tiles = QuantizedLinearTiles(16, 32, 128, 4, 4)
    elif num_rows <= 32:
        tiles = QuantizedLinearTiles(32, 64, 64, 4, 4)
    elif num_rows <= 64:
        tiles = QuantizedLinearTiles(64, 64, 64, 4, 3)
    else:
        tiles = QuantizedLinearTiles(128, 128, 64, 8, 3)
    group = weight.group_size
    small_group = min_block_k(weight.kind, dtype) <= group < tiles.block_k
    if weight.g_idx is None and small_group and (group & (group - 1)) == 0:
        # A K step inside one group loads one scale per output, not one per code.
        tiles = dataclasses.replace(tiles, block_k=group)
    return tiles


def min_block_k(kind: str, dtype: torch.dtype) -> int:
    """The smallest K step for `kind`'s codes against x in `dtype`: 32 for nibbles in a
    16-bit dot (the module docstring: Triton's mma.sync operands for them span 32 inputs),
    else 16, the smallest tl.dot takes."""
    return 32 if kind in NIBBLE_KINDS and dtype in (torch.float16, torch.bfloat16) else 16


@functools.cache
def _has_native_fp8(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def fp8_is_native(device: torch.device) -> bool:
    """Triton can load float8_e4m3fn here: sm_89+, or the interpreter (numpy-backed)."""
    if device.type != "cuda":
        return True
    return _has_native_fp8(
        device.index if device.index is not None else torch.cuda.current_device()
    )


@triton.jit
def _fp8_e4m3fn_bits_to_float(bits):
    """float8_e4m3fn bytes (as int32, 0..255) -> float32: 1 sign, 4 exponent (bias 7) and
    3 mantissa bits; exponent 0 is subnormal (mantissa * 2**-9); no infinities, and
    S.1111.111 is NaN."""
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    # A normal value's float32 bits: exponent rebiased by 127 - 7, mantissa at the top.
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    normal = tl.where((bits & 0x7F) == 0x7F, 0x7FC00000, normal)  # the quiet NaN
    magnitude = normal.to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, magnitude)
    return tl.where((bits & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def _fp4_e2m1_bits_to_float(bits):
    """FP4 E2M1 nibbles (as int32, 0..15) -> float32: 1 sign, 2 exponent (bias 1) and 1
    mantissa bit; exponent 0 is subnormal (mantissa * 0.5); no infinities or NaN. Codes 0..7
    are 0, 0.5, 1, 1.5, 2, 3, 4, 6 (packed_weight.FP4_VALUES), 8..15 the same negated."""
    exponent = (bits >> 1) & 0x3
    mantissa = bits & 0x1
    # A normal value's float32 bits: exponent rebiased by 127 - 1, mantissa at the top.
    normal = (((exponent + 126) << 23) | (mantissa << 22)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)
    return tl.where((bits & 0x8) != 0, -magnitude, magnitude)


@triton.jit
def _quantized_linear_kernel(
    x_ptr,  # [num_rows, in_features]
    codes_ptr,  # [out_features, in_features] (uint4, fp4: [out_features, ceil(in / 2)] bytes)
    scales_ptr,  # [out_features, num_groups] float32
    zeros_ptr,  # [out_features, num_groups] float32, read when HAS_ZEROS
    g_idx_ptr,  # [in_features] int64, read when HAS_G_IDX
    bias_ptr,  # [out_features], read when HAS_BIAS
    out_ptr,  # [num_rows, out_features]
    num_rows,
    out_features,
    in_features,
    group_size,
    stride_x_row,
    stride_x_k,
    stride_codes_n,
    stride_codes_k,
    stride_scales_n,
    stride_zeros_n,
    stride_out_row,
    CODES: tl.constexpr,  # "uint4", "fp4", "uint8", "fp8" (float8_e4m3fn loads), "fp8_bits"
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    ONE_GROUP_PER_BLOCK: tl.constexpr,  # every K step lies inside one group
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_row = rows < num_rows
    is_col = cols < out_features
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)  # out * in codes can pass 2**31 (a large vocabulary's head)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + ks
        is_k = k < in_features
        # Inputs past in_features load as 0, so whatever the weight holds there adds nothing.
        x = tl.load(
            x_ptr + rows64[:, None] * stride_x_row + k[None, :] * stride_x_k,
            mask=is_row[:, None] & is_k[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        w_mask = is_col[:, None] & is_k[None, :]  # [BLOCK_N, BLOCK_K]
        if CODES == "uint4" or CODES == "fp4":
            # Byte j of this step holds inputs k0 + 2j (low nibble) and k0 + 2j + 1 (high);
            # k0 is even (BLOCK_K is), so the step's bytes start at k0 // 2. The last byte
            # of an odd in_features has a padding high nibble, which meets a 0 of x.
            byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(
                codes_ptr + cols64[:, None] * stride_codes_n + byte[None, :] * stride_codes_k,
                mask=is_col[:, None] & (byte * 2 < in_features)[None, :],
                other=0,
            )
            # interleave(low, high)[:, 2j + t] is byte j's nibble t: input k0 + 2j + t.
            nibbles = tl.interleave(packed & 0xF, packed >> 4)
            if CODES == "fp4":
                codes = _fp4_e2m1_bits_to_float(nibbles.to(tl.int32))
            else:
                codes = nibbles.to(tl.float32)
        elif CODES == "fp8_bits":
            packed = tl.load(
                codes_ptr + cols64[:, None] * stride_codes_n + k[None, :] * stride_codes_k,
                mask=w_mask,
                other=0,
            )
            codes = _fp8_e4m3fn_bits_to_float(packed.to(tl.int32))
        else:  # uint8 and fp8: the load's own conversion
            # `other` as a float: the interpreter cannot cast an integer constant to fp8.
            codes = tl.load(
                codes_ptr + cols64[:, None] * stride_codes_n + k[None, :] * stride_codes_k,
                mask=w_mask,
                other=0.0,
            ).to(tl.float32)
        if ONE_GROUP_PER_BLOCK:
            group = k0 // group_size
            scale = tl.load(scales_ptr + cols64 * stride_scales_n + group, mask=is_col, other=0.0)
            if HAS_ZEROS:
                zero = tl.load(zeros_ptr + cols64 * stride_zeros_n + group, mask=is_col, other=0.0)
                codes = codes - zero[:, None]
            w = codes * scale[:, None]
        else:
            if HAS_G_IDX:
                groups = tl.load(g_idx_ptr + k, mask=is_k, other=0)
            else:
                groups = k // group_size
            scale = tl.load(
                scales_ptr + cols64[:, None] * stride_scales_n + groups[None, :],
                mask=w_mask,
                other=0.0,
            )
            if HAS_ZEROS:
                zero = tl.load(
                    zeros_ptr + cols64[:, None] * stride_zeros_n + groups[None, :],
                    mask=w_mask,
                    other=0.0,
                )
                codes = codes - zero
            w = codes * scale
        acc = tl.dot(x, tl.trans(w.to(DOT_DTYPE)), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=is_col, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows64[:, None] * stride_out_row + cols[None, :]
    tl.store(out_ptrs, acc, mask=is_row[:, None] & is_col[None, :])


def _check(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> None:
    if weight.kind not in KINDS:
        raise ValueError(f"unknown packed weight kind {weight.kind!r}; kinds: {', '.join(KINDS)}")
    out_features, in_features = weight.out_features, weight.in_features
    stored = (in_features + 1) // 2 if weight.kind in NIBBLE_KINDS else in_features
    code_dtype = torch.float8_e4m3fn if weight.kind == "fp8" else torch.uint8
    groups = (out_features, weight.num_groups)
    if (
        x.shape[-1] != in_features
        or tuple(weight.codes.shape) != (out_features, stored)
        or weight.codes.dtype != code_dtype
        or tuple(weight.scales.shape) != groups
        or (weight.zeros is not None and tuple(weight.zeros.shape) != groups)
        or (weight.g_idx is not None and tuple(weight.g_idx.shape) != (in_features,))
        or (weight.input_perm is not None and tuple(weight.input_perm.shape) != (in_features,))
        or (bias is not None and tuple(bias.shape) != (out_features,))
    ):
        raise ValueError(
            f"quantized_linear: x {tuple(x.shape)} against a {weight.kind} weight of "
            f"{out_features} x {in_features} with codes {tuple(weight.codes.shape)} "
            f"{weight.codes.dtype}, scales {tuple(weight.scales.shape)}, zeros "
            f"{None if weight.zeros is None else tuple(weight.zeros.shape)}, g_idx "
            f"{None if weight.g_idx is None else tuple(weight.g_idx.shape)}, input_perm "
            f"{None if weight.input_perm is None else tuple(weight.input_perm.shape)}, bias "
            f"{None if bias is None else tuple(bias.shape)}."
        )


def quantized_linear(
    x: torch.Tensor,  # [num_tokens, in_features] (any leading dims)
    weight: PackedWeight,
    bias: torch.Tensor | None = None,
    *,
    tiles: QuantizedLinearTiles | None = None,
    fp8_native: bool | None = None,  # None: as the device allows; False: decode the bits
) -> torch.Tensor:  # [num_tokens, out_features], x's dtype
    """The reference's contract (reference.quantized_linear): w rounded to x's dtype after
    dequantizing in float32, products accumulated in float32, y rounded once."""
    _check(x, weight, bias)
    dot_dtype, dot_precision = dot_operands(x.dtype)  # rejects dtypes the kernels lack
    out_features, in_features = weight.out_features, weight.in_features
    leading = x.shape[:-1]
    x2 = inputs_in_stored_order(x.reshape(-1, in_features), weight)  # [rows, in]
    num_rows = x2.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows == 0 or out_features == 0:
        return out.reshape(*leading, out_features)
    if tiles is None:
        tiles = choose_quantized_linear_tiles(num_rows, x.dtype, weight)
    if tiles.block_k < min_block_k(weight.kind, x.dtype):
        raise ValueError(
            f"quantized_linear: block_k {tiles.block_k} for {weight.kind} codes and {x.dtype} "
            f"x; it must be at least {min_block_k(weight.kind, x.dtype)} (see the module "
            f"docstring: a 16-input step miscompiles on the GPU)."
        )

    codes, kind = weight.codes, weight.kind
    if kind == "fp8" and not (fp8_is_native(x.device) if fp8_native is None else fp8_native):
        codes, kind = codes.view(torch.uint8), "fp8_bits"
    # One group across the whole input (per-channel scales) counts as dividing every step:
    # a group_size of in_features (or more) makes k0 // group_size 0 throughout.
    per_channel = weight.num_groups == 1 and weight.g_idx is None
    group_size = max(weight.group_size, in_features) if per_channel else weight.group_size
    one_group = weight.g_idx is None and (per_channel or group_size % tiles.block_k == 0)
    # The kernel steps along a row of scales, zeros and g_idx with stride 1.
    scales = weight.scales.float().contiguous()
    zeros = weight.zeros.float().contiguous() if weight.zeros is not None else scales
    g_idx = weight.g_idx.contiguous() if weight.g_idx is not None else scales
    grid = (triton.cdiv(num_rows, tiles.block_m), triton.cdiv(out_features, tiles.block_n))
    _quantized_linear_kernel[grid](
        x2,
        codes,
        scales,
        zeros,
        g_idx,
        bias.contiguous() if bias is not None else scales,  # not read without HAS_BIAS
        out,
        num_rows,
        out_features,
        in_features,
        group_size,
        *x2.stride(),
        *codes.stride(),
        scales.stride(0),
        zeros.stride(0),
        out.stride(0),
        CODES=kind,
        HAS_ZEROS=weight.zeros is not None,
        HAS_G_IDX=weight.g_idx is not None,
        ONE_GROUP_PER_BLOCK=one_group,
        HAS_BIAS=bias is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out.reshape(*leading, out_features)
