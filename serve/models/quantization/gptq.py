"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum; TheBloke's and Qwen's `-GPTQ-Int4`).

Per quantized linear layer with `in` inputs and `out` outputs, `b` bits (4 or 8), a
word holding `p = 32 / b` values:

| tensor    | shape               | holds                                                  |
|-----------|---------------------|--------------------------------------------------------|
| `qweight` | int32 [in / p, out] | the codes, packed along the inputs, lowest bits first |
| `qzeros`  | int32 [G, out / p]  | each group's zero point, packed along the outputs      |
| `scales`  | fp16 [G, out]       | each group's scale                                     |
| `g_idx`   | int32 [in]          | each input's group (act order: not `i // group_size`)  |

w[o, i] = (q[i, o] - z[g(i), o]) * s[g(i), o]. The original format (`checkpoint_format`
"gptq", v1) stores each zero point minus one; "gptq_v2" stores it as it is.
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
    input_groups,
    quantized_parameter,
    replicated_parameter,
    unpack_int32,
)


def codes_layout(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[out, in] integer codes -> packed_weight's codes for `bits`."""
    return pack_uint4(codes) if bits == 4 else codes.to(torch.uint8)


class GPTQFormat(QuantFormat):
    method = "gptq"
    marker = "qweight"

    def __init__(self, config: dict[str, Any]) -> None:
        self.bits = int(config.get("bits", 4))
        if self.bits not in (4, 8):
            raise ValueError(
                f"GPTQ with {self.bits} bits: serve runs 4- and 8-bit GPTQ checkpoints"
            )
        self.group_size = int(config.get("group_size", 128))
        self.act_order = bool(config.get("desc_act", False))
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"GPTQ checkpoint_format {fmt!r}: serve reads 'gptq' and 'gptq_v2' "
                "(Marlin's and BitBLAS's repacked formats are not read)"
            )
        self.zero_offset = 1 if fmt == "gptq" else 0
        self.per_word = 32 // self.bits

    def describe(self) -> str:
        group = "per channel" if self.group_size <= 0 else f"groups of {self.group_size}"
        order = ", act order" if self.act_order else ""
        return f"GPTQ {self.bits}-bit, {group}{order}"

    def register(self, layer: nn.Module, sharding: LinearSharding, suffixes: set[str]) -> None:
        drop_float_weight(layer)
        tp_split_inputs = sharding.num_local_inputs != sharding.in_features
        groups = groups_for(sharding, self.group_size, keep_all=self.act_order)
        layer.quant_groups = groups
        p, out = self.per_word, sharding.num_local_outputs
        start, n_in, total = sharding.input_start, sharding.num_local_inputs, sharding.in_features
        code_cols = -(-n_in // 2) if self.bits == 4 else n_in

        def qweight(loaded: LazyTensor, rows: OutputShard) -> torch.Tensor:
            first, count = aligned(start, n_in, p, "GPTQ qweight inputs", total)
            words = loaded.narrow(1, rows.start, rows.num_local_rows)
            words = words.narrow(0, first, count) if tp_split_inputs else words
            codes = unpack_int32(words, self.bits, dim=0)[:n_in]  # [in, rows]
            return codes_layout(codes.t(), self.bits)

        def qzeros(loaded: LazyTensor, rows: OutputShard) -> torch.Tensor:
            first, count = aligned(rows.start, rows.num_local_rows, p, "GPTQ qzeros", rows.num_rows)
            words = loaded.narrow(1, first, count).narrow(0, groups.first, groups.count)
            zeros = unpack_int32(words, self.bits, dim=1)  # [groups, ~rows]
            skip = rows.start - first * p
            zeros = zeros[:, skip : skip + rows.num_local_rows] + self.zero_offset
            return zeros.t().float()

        def scales(loaded: LazyTensor, rows: OutputShard) -> torch.Tensor:
            part = loaded.narrow(1, rows.start, rows.num_local_rows)
            return part.narrow(0, groups.first, groups.count).t().float()

        quantized_parameter(layer, "qweight", (out, code_cols), torch.uint8, qweight, sharding)
        quantized_parameter(layer, "qzeros", (out, groups.count), torch.float32, qzeros, sharding)
        quantized_parameter(layer, "scales", (out, groups.count), torch.float32, scales, sharding)
        if "g_idx" in suffixes:

            def g_idx(loaded: torch.Tensor) -> torch.Tensor:
                return loaded.narrow(0, start, n_in).long() - groups.first

            replicated_parameter(layer, "g_idx", (n_in,), torch.int64, g_idx)

    def packed(self, layer: nn.Module) -> PackedWeight:
        n_in, groups = layer.num_local_inputs, layer.quant_groups
        g_idx = getattr(layer, "g_idx", None)
        if g_idx is not None:
            g_idx = input_groups(layer, g_idx, groups, "GPTQ g_idx")
        elif self.act_order:
            raise ValueError("a GPTQ checkpoint with desc_act must hold g_idx")
        return PackedWeight(
            kind="uint4" if self.bits == 4 else "uint8",
            codes=layer.qweight,
            scales=layer.scales,
            zeros=layer.qzeros,
            group_size=groups.size,
            in_features=n_in,
            g_idx=g_idx,
        )
