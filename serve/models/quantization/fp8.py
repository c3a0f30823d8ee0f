"""FP8 checkpoints with `quant_method: "fp8"` (Qwen3's and DeepSeek-V3's `-FP8`, vLLM's and
AutoFP8's per-tensor exports).

Per quantized linear layer, the weight is float8_e4m3fn [out, in], scaled either

- by blocks (`weight_block_size: [bo, bi]`): `weight_scale_inv` float32
  [ceil(out / bo), ceil(in / bi)], w[o, i] = q[o, i] * s[o // bo, i // bi]; or
- per tensor: `weight_scale` float32 [] (or [1]), w = q * s.

serve runs both weight-only: activations stay in the model's dtype (what vLLM does on GPUs
without FP8 matmuls), so a static scheme's `input_scale` is read and not used.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from serve.kernels.packed_weight import PackedWeight
from serve.models.layers.linear import LinearSharding, OutputShard
from serve.models.lazy_tensor import LazyTensor
from serve.models.quantization.base import (
    QuantFormat,
    aligned,
    drop_float_weight,
    quantized_parameter,
)


class FP8Format(QuantFormat):
    method = "fp8"
    marker = "weight_scale_inv"
    dropped = ("input_scale",)

    def __init__(self, config: dict[str, Any]) -> None:
        fmt = str(config.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"FP8 checkpoint in {fmt!r}: serve reads float8 e4m3 weights")
        block = config.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(int(b) for b in block) < 1):
            raise ValueError(f"weight_block_size {block}: expected [rows, columns]")
        self.block = None if block is None else (int(block[0]), int(block[1]))
        self.marker = "weight_scale_inv" if self.block is not None else "weight_scale"

    def describe(self) -> str:
        if self.block is None:
            return "FP8 (e4m3) weights, one scale per tensor"
        return f"FP8 (e4m3) weights in blocks of {self.block[0]}x{self.block[1]}"

    def register(self, layer: nn.Module, sharding: LinearSharding, suffixes: set[str]) -> None:
        drop_float_weight(layer)
        out, start, n_in = (
            sharding.num_local_outputs,
            sharding.input_start,
            sharding.num_local_inputs,
        )
        total_in = sharding.in_features

        def weight(loaded: LazyTensor, rows: OutputShard) -> torch.Tensor:
            part = loaded.narrow(0, rows.start, rows.num_local_rows)
            if part.dtype != torch.float8_e4m3fn:
                raise ValueError(f"an FP8 layer's weight is {part.dtype}, not float8_e4m3fn")
            return part.narrow(1, start, n_in)

        quantized_parameter(layer, "weight", (out, n_in), torch.float8_e4m3fn, weight, sharding)
        if self.block is None:

            def per_tensor(loaded: LazyTensor, rows: OutputShard) -> torch.Tensor:
                scale = loaded.load().float().reshape(-1)
                if scale.numel() != 1:
                    raise ValueError(f"a per-tensor weight_scale has {scale.numel()} values")
                return scale.expand(rows.num_local_rows).reshape(-1, 1)

            quantized_parameter(
                layer, "weight_scale", (out, 1), torch.float32, per_tensor, sharding
            )
            layer.quant_group_size = max(n_in, 1)
            return
        block_rows, block_cols = self.block

        def per_block(loaded: LazyTensor, rows: OutputShard) -> torch.Tensor:
            first_row, row_blocks = aligned(
                rows.start, rows.num_local_rows, block_rows, "FP8 weight blocks", rows.num_rows
            )
            first_col, col_blocks = aligned(start, n_in, block_cols, "FP8 weight blocks", total_in)
            scales = loaded.narrow(0, first_row, row_blocks).narrow(1, first_col, col_blocks)
            scales = scales.float().repeat_interleave(block_rows, dim=0)
            skip = rows.start - first_row * block_rows
            return scales[skip : skip + rows.num_local_rows]

        col_blocks = -(-n_in // block_cols)
        quantized_parameter(
            layer, "weight_scale_inv", (out, col_blocks), torch.float32, per_block, sharding
        )
        layer.quant_group_size = block_cols

    def packed(self, layer: nn.Module) -> PackedWeight:
        scales = layer.weight_scale_inv if self.block is not None else layer.weight_scale
        return PackedWeight(
            kind="fp8",
            codes=layer.weight,
            scales=scales,
            zeros=None,
            group_size=layer.quant_group_size,
            in_features=layer.num_local_inputs,
        )
