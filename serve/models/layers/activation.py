from __future__ import annotations

import torch
from torch import nn

from serve import kernels


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 * d] -> [T, d]
        return kernels.silu_and_mul(x)
