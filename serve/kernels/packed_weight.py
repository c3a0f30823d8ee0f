"""A quantized linear layer's weight in the one layout every kernel reads.

Checkpoints come in several layouts (GPTQ packs 4-bit codes along the inputs in int32
words, AWQ along the outputs in a shuffled order, FP8 checkpoints store float8 values with
block or per-tensor scales, compressed-tensors packs along the inputs with its own signs);
`serve.models.quantization` converts each, while loading, into this one. A kernel then has
one contract to meet:

    w[o, i] = (code(o, i) - zeros[o, g(i)]) * scales[o, g(i)]      (zeros None: 0)
    g(i)    = g_idx[i] if g_idx is not None else i // group_size
    y       = x[:, input_perm] @ w.T + bias                        (input_perm None: x)

| kind     | codes                          | code(o, i)                                    |
|----------|--------------------------------|-----------------------------------------------|
| `uint4`  | uint8 [out, ceil(in / 2)]      | `(codes[o, i // 2] >> (4 * (i % 2))) & 0xF`   |
| `uint8`  | uint8 [out, in]                | `codes[o, i]`                                 |
| `fp8`    | float8_e4m3fn [out, in]        | `float(codes[o, i])`                          |
| `fp4`    | uint8 [out, ceil(in / 2)]      | `FP4_VALUES[uint4's nibble]` (E2M1, signed)   |

`fp4` is OCP microscaling FP4 (MXFP4, GPT-OSS's experts): E2M1 codes packed as uint4's,
with no zero points and, in MXFP4, groups of 32 sharing a power-of-two scale, which
`mxfp4_weight` turns from its E8M0 byte into float32 at load.

Scales and zero points are float32 `[out, num_groups]`, output-major like the codes, so a
fused layer (q/k/v, gate/up) is its parts' rows stacked, each part with its own groups.

GPTQ's act order (`desc_act`) scatters each group's inputs over the row (`g_idx`), so a
kernel would look every input's group up. Where every group is whole (`group_size`
inputs, the last maybe fewer), `sort_inputs_by_group` stores the inputs sorted by group
instead: the codes' input columns in `input_perm`'s order, groups contiguous (`g_idx`
None), and the kernels gather x's columns into that order once per call (a copy of x,
far cheaper than a lookup per weight). `input_perm[i]` is the checkpoint's input that
stored input i multiplies; `reference.dequantize` returns w in the checkpoint's order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

KINDS = ("uint4", "uint8", "fp8", "fp4")
# The kinds whose codes are nibbles, two a byte, the even input in the low one.
NIBBLE_KINDS = ("uint4", "fp4")
# FP4 E2M1's 16 codes: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0
# is subnormal (mantissa * 0.5). No infinities or NaN.
_FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = _FP4_MAGNITUDES + tuple(-v for v in _FP4_MAGNITUDES)  # codes 8..15: sign set
# MXFP4's shared scale: an E8M0 byte e is 2^(e - 127), 255 NaN.
MXFP4_GROUP_SIZE = 32
E8M0_BIAS = 127


@dataclass(frozen=True)
class PackedWeight:
    kind: str  # one of KINDS
    codes: torch.Tensor  # see the table above
    scales: torch.Tensor  # [out, num_groups] float32
    zeros: torch.Tensor | None  # [out, num_groups] float32, in code units; None: 0
    group_size: int  # inputs per group where g_idx is None
    in_features: int
    g_idx: torch.Tensor | None = None  # [in] int64: each input's group (GPTQ's act order)
    input_perm: torch.Tensor | None = None  # [in] int64: x's column each stored input reads

    def __post_init__(self) -> None:
        if self.g_idx is not None and self.input_perm is not None:
            raise ValueError(
                "a packed weight's inputs are reordered (input_perm) or looked up (g_idx), not both"
            )
        if self.kind == "fp4" and self.zeros is not None:
            raise ValueError("fp4 codes are signed values: a packed fp4 weight has no zeros")

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1]


def pack_uint4(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] values 0..15 (any integer dtype) -> uint8 [out, ceil(in / 2)], the even
    input in the low nibble."""
    codes = codes.to(torch.uint8)
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_uint4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 [out, ceil(in / 2)] -> uint8 [out, in], each value 0..15."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(1)[:, :in_features]


def codes_as_float(weight: PackedWeight) -> torch.Tensor:
    """code(o, i) as float32 [out, in]."""
    if weight.kind == "uint4":
        return unpack_uint4(weight.codes, weight.in_features).float()
    if weight.kind == "fp4":
        table = torch.tensor(FP4_VALUES, device=weight.codes.device)
        return table[unpack_uint4(weight.codes, weight.in_features).long()]
    if weight.kind in ("uint8", "fp8"):
        return weight.codes.float()
    raise ValueError(f"unknown packed weight kind {weight.kind!r}; kinds: {', '.join(KINDS)}")


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes e -> float32 2^(e - 127), exactly (ldexp); 255 is E8M0's NaN."""
    exponents = scales.to(torch.int32) - E8M0_BIAS
    float_scales = torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents)
    return float_scales.masked_fill(scales == 255, float("nan"))


def mxfp4_weight(blocks: torch.Tensor, scales: torch.Tensor) -> PackedWeight:
    """An MXFP4 (OCP microscaling FP4) weight as a packed `fp4` one. `blocks`: uint8
    [out, in / 32, 16] (GPT-OSS's `*_blocks`, one expert's) or [out, in / 2], E2M1 codes two
    a byte, the even input in the low nibble, as uint4 packs them; `scales`: uint8
    [out, in / 32] (`*_scales`), each group of 32 inputs' E8M0 exponent e, scale 2^(e - 127),
    made float32 here exactly (ldexp)."""
    out_features = blocks.shape[0]
    codes = blocks.reshape(out_features, -1)  # [out, in / 2]
    num_groups = scales.shape[-1]
    if scales.shape != (out_features, num_groups) or codes.shape[1] != num_groups * 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: expected "
            f"[out, in / 32, 16] (or [out, in / 2]) and [out, in / 32]"
        )
    return PackedWeight(
        "fp4",
        codes.to(torch.uint8).contiguous(),
        e8m0_to_float(scales),
        None,
        MXFP4_GROUP_SIZE,
        num_groups * MXFP4_GROUP_SIZE,
    )


def group_of_inputs(weight: PackedWeight) -> torch.Tensor:
    """g(i) for every input, int64 [in]."""
    if weight.g_idx is not None:
        return weight.g_idx
    return torch.arange(weight.in_features, device=weight.scales.device) // weight.group_size


def permute_inputs(weight: PackedWeight, perm: torch.Tensor) -> torch.Tensor:
    """The codes with stored input i holding input perm[i]'s: [out, in] -> the same
    layout (nibbles unpacked, gathered and packed again)."""
    if weight.kind in NIBBLE_KINDS:
        return pack_uint4(unpack_uint4(weight.codes, weight.in_features)[:, perm])
    return weight.codes[:, perm]


def sort_inputs_by_group(weight: PackedWeight) -> PackedWeight:
    """Act order's weight with its inputs sorted by group (the module docstring): new
    codes, g_idx None, input_perm the stable sort. Unchanged where there is no g_idx, or
    where the sorted groups are not whole `group_size` runs over all `num_groups` (a
    tensor-parallel rank's slice of a row-parallel layer holds parts of groups): those
    keep the lookup."""
    if weight.g_idx is None:
        return weight
    perm = torch.argsort(weight.g_idx, stable=True)  # [in]
    in_order = torch.arange(weight.in_features, device=perm.device) // weight.group_size
    whole = -(-weight.in_features // weight.group_size) == weight.num_groups
    if not whole or not torch.equal(weight.g_idx[perm], in_order):
        return weight
    codes = permute_inputs(weight, perm)
    return replace(weight, codes=codes, g_idx=None, input_perm=perm)


def inputs_in_stored_order(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """x [..., in] with its columns in the order the weight stores its inputs: x itself
    unless the inputs were sorted by group (`input_perm`)."""
    if weight.input_perm is None:
        return x
    return x.index_select(-1, weight.input_perm)
