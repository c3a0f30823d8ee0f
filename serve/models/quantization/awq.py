"""AWQ checkpoints (AutoAWQ's GEMM layout; TheBloke's and Qwen's `-AWQ`).

Per quantized linear layer with `in` inputs and `out` outputs, 4 bits, groups of `g`
inputs:

| tensor    | shape                | holds                                                   |
|-----------|----------------------|---------------------------------------------------------|
| `qweight` | int32 [in, out / 8]  | the codes, packed along the outputs, shuffled (below)   |
| `qzeros`  | int32 [in / g, out / 8] | each group's zero point, packed the same way         |
| `scales`  | fp16 [in / g, out]   | each group's scale                                      |

Word j of a row holds outputs 8j .. 8j + 7, output 8j + m in its 4-bit field
`FIELD_OF_OUTPUT[m]` (the order AutoAWQ's GEMM kernel reads them in).
w[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o].
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from serve.kernels.packed_weight import PackedWeight, pack_uint4
from serve.models.layers.linear import LinearSharding, OutputShard
from serve.models.lazy_tensor import LazyTensor
from serve.models.quantization.base import (
    QuantFormat,
    aligned,
    drop_float_weight,
    groups_for,
    quantized_parameter,
    unpack_int32,
)

FIELD_OF_OUTPUT = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_outputs(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, n / 8] in AWQ's order -> int32 [rows, n] values 0..15, in output order."""
    fields = unpack_int32(words, 4, dim=1).view(words.shape[0], -1, 8)
    order = torch.tensor(FIELD_OF_OUTPUT, device=words.device)
    return fields[:, :, order].flatten(1)


class AWQFormat(QuantFormat):
    method = "awq"
    marker = "qweight"

    def __init__(self, config: dict[str, Any]) -> None:
        bits = int(config.get("bits", config.get("w_bit", 4)))
        version = str(config.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not config.get("zero_point", True):
            raise ValueError(
                f"AWQ {bits}-bit, version {version!r}, zero_point "
                f"{config.get('zero_point', True)}: serve reads AutoAWQ's 4-bit GEMM "
                "checkpoints with zero points (version 'gemm'; GEMV and Marlin layouts are "
                "not read)"
            )
        self.group_size = int(config.get("group_size", config.get("q_group_size", 128)))

    def describe(self) -> str:
        return f"AWQ 4-bit, groups of {self.group_size}"

    def register(self, layer: nn.Module, sharding: LinearSharding, suffixes: set[str]) -> None:
        drop_float_weight(layer)
        groups = groups_for(sharding, self.group_size, keep_all=False)
        layer.quant_groups = groups
        out, start, n_in = (
            sharding.num_local_outputs,
            sharding.input_start,
            sharding.num_local_inputs,
        )

        def words(loaded: LazyTensor, rows: OutputShard, what: str) -> tuple[torch.Tensor, int]:
            first, count = aligned(rows.start, rows.num_local_rows, 8, what, rows.num_rows)
            return loaded.narrow(1, first, count), rows.start - first * 8

        def qweight(loaded: LazyTensor, rows: OutputShard) -> torch.Tensor:
            packed, skip = words(loaded, rows, "AWQ qweight outputs")
            codes = unpack_outputs(packed.narrow(0, start, n_in))
            return pack_uint4(codes[:, skip : skip + rows.num_local_rows].t())

        def qzeros(loaded: LazyTensor, rows: OutputShard) -> torch.Tensor:
            packed, skip = words(loaded, rows, "AWQ qzeros outputs")
            zeros = unpack_outputs(packed.narrow(0, groups.first, groups.count))
            return zeros[:, skip : skip + rows.num_local_rows].t().float()

        def scales(loaded: LazyTensor, rows: OutputShard) -> torch.Tensor:
            part = loaded.narrow(1, rows.start, rows.num_local_rows)
            return part.narrow(0, groups.first, groups.count).t().float()

        code_cols = -(-n_in // 2)
        quantized_parameter(layer, "qweight", (out, code_cols), torch.uint8, qweight, sharding)
        quantized_parameter(layer, "qzeros", (out, groups.count), torch.float32, qzeros, sharding)
        quantized_parameter(layer, "scales", (out, groups.count), torch.float32, scales, sharding)

    def packed(self, layer: nn.Module) -> PackedWeight:
        return PackedWeight(
            kind="uint4",
            codes=layer.qweight,
            scales=layer.scales,
            zeros=layer.qzeros,
            group_size=layer.quant_groups.size,
            in_features=layer.num_local_inputs,
        )
