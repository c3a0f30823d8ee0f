"""A quantized linear layer's weight in the one layout every kernel reads.

Checkpoints come in several layouts (GPTQ packs 4-bit codes along the inputs in int32
words, AWQ along the outputs in a shuffled order, FP8 checkpoints store float8 values with
block or per-tensor scales, compressed-tensors packs along the inputs with its own signs);
`serve.models.quantization` converts each, while loading, into this one. A kernel then has
one contract to meet:

    w[o, i] = (code(o, i) - zeros[o, g(i)]) * scales[o, g(i)]      (zeros None: 0)
    g(i)    = g_idx[i] if g_idx is not None else i // group_size
    y       = x @ w.T + bias

| kind     | codes                          | code(o, i)                                    |
|----------|--------------------------------|-----------------------------------------------|
| `uint4`  | uint8 [out, ceil(in / 2)]      | `(codes[o, i // 2] >> (4 * (i % 2))) & 0xF`   |
| `uint8`  | uint8 [out, in]                | `codes[o, i]`                                 |
| `fp8`    | float8_e4m3fn [out, in]        | `float(codes[o, i])`                          |

Scales and zero points are float32 `[out, num_groups]`, output-major like the codes, so a
fused layer (q/k/v, gate/up) is its parts' rows stacked, each part with its own groups.
"""

from __future__ import annotations

from dataclasses import dataclass

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
