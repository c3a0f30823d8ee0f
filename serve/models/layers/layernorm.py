from __future__ import annotations

import torch
from torch import nn

from serve import kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With `residual`: returns (norm(x + residual), x + residual), the pre-norm block's pair."""
        return kernels.rms_norm(x, self.weight, self.eps, residual)
