"""A sparse mixture-of-experts MLP: a router picks each token's top-k SwiGLU experts.

| module (checkpoint name)  | here                                                         |
|---------------------------|--------------------------------------------------------------|
| `gate`                    | the router, ReplicatedLinear [num_experts, hidden]           |
| `experts.{e}.gate_proj`   | `experts.w13_weight[e]`, rows [0, inter / tp): its gate      |
| `experts.{e}.up_proj`     | `experts.w13_weight[e]`, rows [inter / tp, 2 inter / tp): up  |
| `experts.{e}.down_proj`   | `experts.w2_weight[e]`, [hidden, inter / tp]                 |
| `shared_expert`           | a dense gated MLP every token runs (Qwen2-MoE), not reduced  |
| `shared_expert_gate`      | its gate, ReplicatedLinear [1, hidden]: sigmoid scales it    |

Tensor parallel: every rank holds a slice of every expert, the columns [r * inter / tp,
(r + 1) * inter / tp) of its intermediate width (column-parallel gate/up, row-parallel
down), so each rank computes every routed token's partial sums; the routed and shared
experts' partial sums are added and all-reduced once. The router is replicated: every
rank routes every token alike.

The experts run through `kernels.moe_experts`, which computes only the routed (token,
expert) pairs. Routing follows transformers' order of operations exactly (`route`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from serve import kernels
from serve.distributed.parallel_state import get_tp_group
from serve.kernels.reference import routed_experts
from serve.models.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    check_checkpoint_shape,
)
from serve.models.lazy_tensor import LazyTensor, as_lazy
from serve.models.partition import split_evenly


class ExpertShard(NamedTuple):
    """What a per-expert checkpoint tensor is: expert `expert`'s "gate", "up" or "down"."""

    expert: int
    name: str


def route(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
    float32_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, top_k] weights, [T, top_k] int64 expert ids)
    """Softmax in float32 over all experts, the top k, renormalised to sum to 1 if asked
    (Mixtral always; Qwen's `norm_topk_prob`). Mixtral keeps the weights in float32; Qwen
    casts them back to the logits' dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True)
    if not float32_weights:
        topk_weights = topk_weights.to(router_logits.dtype)
    return topk_weights, topk_ids


class FusedMoE(nn.Module):
    """The routed experts' weights, stacked per layer, this rank's slice of each:
    `w13_weight` [num_experts, 2 * inter / tp, hidden] (gate rows, then up rows) and
    `w2_weight` [num_experts, hidden, inter / tp]. `forward` returns this rank's partial
    sums; the caller all-reduces."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size  # all ranks together
        self.num_local_inter = split_evenly(intermediate_size, tp.world_size, "expert width")
        self.inter_start = tp.rank * self.num_local_inter
        local = self.num_local_inter
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * local, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, local), requires_grad=False
        )
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader

        self.quantized = False

    @property
    def reads_host(self) -> bool:
        """Quantized experts run one at a time (`routed_experts`), sized on the host from
        each step's routing: a CUDA graph cannot capture that (cuda_graphs.host_reader)."""
        return self.quantized

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        topk_weights: torch.Tensor,  # [T, top_k]
        topk_ids: torch.Tensor,  # [T, top_k]
    ) -> torch.Tensor:  # [T, hidden], this rank's partial sums
        if self.quantized:
            return routed_experts(x, topk_weights, topk_ids, self.num_experts, self._packed_mlp)
        return kernels.moe_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)

    def _packed_mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        layers = self.get_submodule(str(expert))
        return layers.w2(kernels.silu_and_mul(layers.w13(rows)))

    def quantize_experts(self, fmt: Any, suffixes: set[str]) -> None:
        """A quantized checkpoint's experts: each expert its own packed layers, `{e}.w13`
        (gate and up, this rank's columns of each) and `{e}.w2` (down, this rank's inputs),
        in place of the stacked float weights; they run one routed expert at a time."""
        inter, hidden = self.intermediate_size, self.hidden_size
        for expert in range(self.num_experts):
            layers = nn.Module()
            layers.w13 = MergedColumnParallelLinear(hidden, [inter, inter], ["gate", "up"])
            layers.w2 = RowParallelLinear(inter, hidden, reduce_results=False)
            for layer in (layers.w13, layers.w2):
                fmt.register(layer, layer.sharding(), suffixes)
                layer.quant_format = fmt
            self.add_module(str(expert), layers)
        del self.w13_weight, self.w2_weight
        self.quantized = True

    def weight_loader(
        self, param: nn.Parameter, loaded: LazyTensor | torch.Tensor, shard: ExpertShard | None
    ) -> None:
        """One expert's gate, up or down projection, of the full (unsharded) shape; reads
        only this rank's intermediate columns."""
        if not isinstance(shard, ExpertShard) or not 0 <= shard.expert < self.num_experts:
            raise ValueError(f"expected one of {self.num_experts} experts' shards, got {shard!r}")
        loaded = as_lazy(loaded)
        inter, hidden, local = self.intermediate_size, self.hidden_size, self.num_local_inter
        if param is self.w13_weight and shard.name in ("gate", "up"):
            check_checkpoint_shape(loaded, (inter, hidden), f"expert {shard.expert} {shard.name}")
            rows = param.data[shard.expert].narrow(0, 0 if shard.name == "gate" else local, local)
            rows.copy_(loaded.narrow(0, self.inter_start, local))
        elif param is self.w2_weight and shard.name == "down":
            check_checkpoint_shape(loaded, (hidden, inter), f"expert {shard.expert} down")
            param.data[shard.expert].copy_(loaded.narrow(1, self.inter_start, local))
        else:
            raise ValueError(f"shard {shard.name!r} does not belong in this parameter")


class SparseMoeBlock(nn.Module):
    """Router, routed experts, and an optional sigmoid-gated shared expert (a dense MLP
    built by the model with `reduce_results=False`); one all-reduce at the end."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,  # one expert's width, all ranks together
        *,
        renormalize: bool,
        float32_weights: bool = False,
        hidden_act: str = "silu",
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"MoE experts support the silu activation, got {hidden_act!r}.")
        self.tp = get_tp_group()
        self.top_k, self.renormalize, self.float32_weights = top_k, renormalize, float32_weights
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1) if shared_expert else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden], reduced
        router_logits = self.gate(x)  # [T, num_experts]
        topk_weights, topk_ids = route(
            router_logits, self.top_k, self.renormalize, self.float32_weights
        )
        out = self.experts(x, topk_weights, topk_ids)  # [T, hidden], partial
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x)  # [T, hidden], partial
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return self.tp.all_reduce(out)
