"""Activations by their HF config names, numerically as transformers computes them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from serve import kernels


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # The tanh approximation, written out as GPT-2's code (and transformers' `gelu_new`) has it.
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": _gelu_new,
    "gelu_fast": _gelu_fast,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"activation {name!r} is not supported (supported: {', '.join(sorted(_ACTIVATIONS))})."
        )
    return _ACTIVATIONS[name]


class Activation(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.fn = get_activation(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class ActAndMul(nn.Module):
    """Gated MLP activation: [T, 2d] -> act(x[:, :d]) * x[:, d:] (SwiGLU, GeGLU)."""

    def __init__(self, name: str = "silu") -> None:
        super().__init__()
        self.name = name
        self.fn = get_activation(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2 * d] -> [T, d]
        if self.name in ("silu", "swish"):
            return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return self.fn(gate) * up


SiluAndMul = ActAndMul  # the default gate is silu
