"""Linear layers that know how to load their HF weights, including fused projections."""

from __future__ import annotations

import torch
from torch import nn

from serve import kernels


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked into one matmul (q/k/v, gate/up).

    Each HF checkpoint tensor is one shard, named by `shard_names`; `weight_loader` copies it
    into its rows.
    """

    def __init__(
        self, in_features: int, output_sizes: list[int], shard_names: list[str], bias: bool = False
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self._shards = {n: (o, s) for n, o, s in zip(shard_names, offsets, output_sizes)}
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_name: str) -> None:
        offset, size = self._shards[shard_name]
        target = param.data.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(
                f"{shard_name} shard shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.split(self.output_sizes, dim=-1)
