"""MXFP4 checkpoints with `quant_method: "mxfp4"`: OpenAI's GPT-OSS releases.

Only the mixture-of-experts projections are quantized (config.json's
`modules_to_not_convert` keeps attention, the router, the embeddings and the head in
bfloat16). Per layer, `mlp.experts.{gate_up,down}_proj_blocks` hold each weight as an FP4
E2M1 code, two a byte along the inputs (even input in the low nibble), [experts, out,
in / 32, 16] bytes, and `..._scales` one E8M0 exponent byte per 32 inputs, [experts, out,
in / 32]: w = FP4(code) * 2^(scale - 127). The model's experts module reads them
(`quantize`, gpt_oss.py) into `PackedWeight`s of kind fp4, kept packed; this format only
names the method and the marker, and refuses linear layers (the scheme has none).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from serve.kernels.packed_weight import PackedWeight
from serve.models.layers.linear import LinearSharding
from serve.models.quantization.base import QuantFormat


class MXFP4Format(QuantFormat):
    method = "mxfp4"
    marker = "gate_up_proj_blocks"

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def describe(self) -> str:
        return "MXFP4 (FP4 E2M1, a power-of-two scale per 32 inputs) experts"

    def register(self, layer: nn.Module, sharding: LinearSharding, suffixes: set[str]) -> None:
        raise ValueError(
            "MXFP4 is read for GPT-OSS's experts only; this checkpoint holds a linear layer in it"
        )

    def packed(self, layer: nn.Module) -> PackedWeight:
        raise ValueError("MXFP4 experts pack themselves (gpt_oss.py)")
