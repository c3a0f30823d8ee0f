"""Normalisation layers. Replicated on every rank (they act on the full hidden vector), but
for ShardedRMSNorm, which normalises a vector split over the ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serve import kernels
from serve.distributed.parallel_state import get_tp_group
from serve.models.layers.linear import check_checkpoint_shape, default_weight_loader
from serve.models.lazy_tensor import LazyTensor, as_lazy


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`, computed in float32.

    `weight_offset` is added to the checkpoint's weight when it loads: Gemma stores w and
    multiplies by (1 + w), which in float32 is the same number as a stored (1 + w).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps, self.weight_offset = eps, weight_offset
        if weight_offset:
            self.weight.weight_loader = self._load_offset_weight

    def _load_offset_weight(
        self, param: nn.Parameter, loaded: LazyTensor | torch.Tensor, shard_name: str | None = None
    ) -> None:
        default_weight_loader(param, loaded, shard_name)
        param.data.copy_((as_lazy(loaded).load().float() + self.weight_offset).to(param.dtype))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With `residual`: returns (norm(x + residual), x + residual), the pre-norm block's pair."""
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    """torch's LayerNorm (as HF's models use it) with loadable weight and optional bias;
    `elementwise_affine=False` (OPT's option) has neither."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        elementwise_affine: bool = True,
    ) -> None:
        super().__init__()
        self.weight = self.bias = None
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        if elementwise_affine and bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With `residual`, the same pair as RMSNorm: (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps), x
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


def norm_adding(
    norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): a pre-norm layer's input norm, which takes the add
    the previous layer left it; the first layer's input is the residual, (norm(x), x)."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector whose entries are split across the tensor-parallel ranks (OLMo 2
    normalises the whole q and k projections, not each head). Rank r holds entries
    [start, start + num_local) of `size`; the sums of squares are all-reduced so every rank
    divides by the whole vector's rms. Where KV heads are replicated, `num_copies` ranks
    hold each entry and the reduced sum counts it that many times.
    """

    def __init__(
        self, size: int, start: int, num_local: int, eps: float, num_copies: int = 1
    ) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.size, self.start, self.num_copies, self.eps = size, start, num_copies, eps
        self.weight = nn.Parameter(torch.ones(num_local), requires_grad=False)
        self.weight.weight_loader = self._load_weight

    def _load_weight(
        self, param: nn.Parameter, loaded: LazyTensor | torch.Tensor, shard_name: str | None = None
    ) -> None:
        if shard_name is not None:
            raise ValueError(f"a norm weight has no shard {shard_name!r}")
        loaded = as_lazy(loaded)
        check_checkpoint_shape(loaded, (self.size,), "weight")
        param.data.copy_(loaded.narrow(0, self.start, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, num_local] -> [T, num_local]
        if self.tp.world_size == 1:
            return kernels.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        sum_sq = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True))  # [T, 1], all ranks
        mean_sq = sum_sq / (self.size * self.num_copies)
        return (self.weight * (x32 * torch.rsqrt(mean_sq + self.eps))).to(x.dtype)
