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

KINDS = ("uint4", "uint8", "fp8")


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
    if weight.kind in ("uint8", "fp8"):
        return weight.codes.float()
    raise ValueError(f"unknown packed weight kind {weight.kind!r}; kinds: {', '.join(KINDS)}")


def group_of_inputs(weight: PackedWeight) -> torch.Tensor:
    """g(i) for every input, int64 [in]."""
    if weight.g_idx is not None:
        return weight.g_idx
    return torch.arange(weight.in_features, device=weight.scales.device) // weight.group_size


def permute_inputs(weight: PackedWeight, perm: torch.Tensor) -> torch.Tensor:
    """The codes with stored input i holding input perm[i]'s: [out, in] -> the same
    layout (uint4 unpacked, gathered and packed again)."""
    if weight.kind == "uint4":
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
