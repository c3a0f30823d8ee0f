"""`--quantization fp8` over a float checkpoint: each linear layer's weight rounded to FP8
as it loads, as vLLM's online FP8 does, halving a 16-bit model's linear weights.

Each output row gets its own scale (its largest magnitude over FP8's largest, 448), which
keeps a row of small weights from rounding to zero beside a row of large ones. The LM
head and embeddings stay as they are; so does anything that is not one of serve's linear
layers (a vision tower's).
"""

from __future__ import annotations

import torch
from torch import nn

from serve.kernels.packed_weight import PackedWeight
from serve.models.layers.linear import LINEAR_LAYERS

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (float8_e4m3fn codes [out, in], float32 scales [out, 1])."""
    scales = (weight.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (weight.float() / scales).to(torch.float8_e4m3fn), scales


def quantize_to_fp8(model: nn.Module) -> int:
    """Round every loaded linear layer of `model` to FP8 in place; how many were."""
    count = 0
    for module in model.modules():
        if not isinstance(module, LINEAR_LAYERS) or module.packed_weight is not None:
            continue
        codes, scales = fp8_rows(module.weight.data)
        del module.weight
        module.register_parameter("weight", nn.Parameter(codes, requires_grad=False))
        module.register_parameter("weight_scale", nn.Parameter(scales, requires_grad=False))
        module.packed_weight = PackedWeight(
            kind="fp8",
            codes=module.weight,
            scales=module.weight_scale,
            zeros=None,
            group_size=max(module.num_local_inputs, 1),
            in_features=module.num_local_inputs,
        )
        count += 1
    return count
