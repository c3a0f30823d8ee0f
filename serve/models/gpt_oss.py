"""GPT-OSS (openai/gpt-oss-20b, -120b): the Llama block with attention sinks and biased,
clamped-SwiGLU experts.

Attention: q/k/v and o with biases, GQA, neox rotary with YaRN, a sliding window on every
other layer (`layer_types`), and one learned sink logit per head that joins each query's
softmax denominator without a value (`Attention(sinks=True)`).

Every MLP is a mixture of experts (`GptOssMoE`). The router is a biased linear; each token
takes its top-k logits, softmaxed among themselves. An expert computes

    gate, up = (W_gu x + b_gu) split;  gate <= limit, -limit <= up <= limit
    y        = W_d ((up + 1) * gate * sigmoid(alpha * gate)) + b_d

| checkpoint tensor (per layer)                 | here                                        |
|-----------------------------------------------|---------------------------------------------|
| `mlp.experts.gate_up_proj` [E, hidden, 2I]    | `gate_up_proj` [E, 2I/tp, hidden]: columns interleave gate, up; stored gate rows then up rows, this rank's |
| `mlp.experts.gate_up_proj_bias` [E, 2I]       | `gate_up_proj_bias` [E, 2I/tp], likewise     |
| `mlp.experts.down_proj` [E, I, hidden]        | `down_proj` [E, hidden, I/tp], transposed    |
| `mlp.experts.down_proj_bias` [E, hidden]      | `down_proj_bias`, whole: added by rank 0     |
| `mlp.router.weight` / `.bias`                 | `router`, a ReplicatedLinear                  |
| `self_attn.sinks` [heads]                     | `self_attn.attn.sinks`, this rank's heads    |

Tensor parallel: each rank holds its slice of every expert's intermediate width (rank r's
gate/up columns are the contiguous run [2 r I/tp, 2 (r + 1) I/tp) of the interleaved
layout); the routed partial sums are all-reduced once, the down bias counted at rank 0.

OpenAI's releases store the experts in MXFP4 (quantization/mxfp4.py): `{gate_up,down}
_proj_blocks` and `_scales` in place of the float tensors, rows output-major. They stay
packed (`quantize_experts`): per expert a `PackedWeight` of kind fp4 each call reads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from serve import kernels
from serve.distributed.parallel_state import get_tp_group
from serve.kernels.packed_weight import MXFP4_GROUP_SIZE as GROUP_SIZE
from serve.kernels.packed_weight import PackedWeight, e8m0_to_float
from serve.kernels.reference import routed_experts
from serve.models.arch_config import ArchConfig
from serve.models.layers.linear import ReplicatedLinear, check_checkpoint_shape
from serve.models.lazy_tensor import LazyTensor, as_lazy
from serve.models.llama import LLAMA_PACKED, LlamaAttention, LlamaForCausalLM
from serve.models.partition import split_evenly
from serve.models.weights import WeightSpec


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[T, 2 I] (gate columns, then up) -> [T, I], in transformers' order of operations."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def deinterleave(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Columns (g0, u0, g1, u1, ...) along `dim` (>= 0) -> (g0, g1, ..., u0, u1, ...)."""
    pairs = x.unflatten(dim, (-1, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)


class GptOssExperts(nn.Module):
    """Every expert's projections and biases, stacked, this rank's intermediate slice;
    `forward` returns this rank's partial sums (the caller all-reduces)."""

    # Its experts run one at a time (`routed_experts`), sized on the host from each step's
    # routing: decode steps run eagerly, not as CUDA graphs (cuda_graphs.host_reader).
    reads_host = True

    def __init__(self, hf: Any, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.num_experts, self.hidden_size = int(hf.num_local_experts), hidden_size
        self.intermediate_size = int(hf.intermediate_size)  # all ranks together
        self.local = split_evenly(self.intermediate_size, tp.world_size, "intermediate_size")
        self.start, self.is_first_rank = tp.rank * self.local, tp.rank == 0
        self.alpha, self.limit = float(hf.swiglu_alpha), float(hf.swiglu_limit)
        experts, local = self.num_experts, self.local
        shapes = {
            "gate_up_proj": (experts, 2 * local, hidden_size),
            "gate_up_proj_bias": (experts, 2 * local),
            "down_proj": (experts, hidden_size, local),
            "down_proj_bias": (experts, hidden_size),
        }
        for name, shape in shapes.items():
            param = nn.Parameter(torch.empty(shape), requires_grad=False)
            param.weight_loader = self.weight_loader
            self.register_parameter(name, param)
        self.is_packed = False

    def quantize_experts(self, fmt: Any, suffixes: set[str]) -> None:
        """MXFP4 experts: the float projections' place taken by their codes and scales,
        this rank's slice, gate/up rows de-interleaved like the float ones'. Called before
        the weights load (quantization.quantize_layers)."""
        needed = {f"{p}_proj_{t}" for p in ("gate_up", "down") for t in ("blocks", "scales")}
        if not needed <= suffixes:
            raise ValueError(
                f"MXFP4 experts need {sorted(needed)}; the checkpoint has {sorted(suffixes)}"
            )
        if self.hidden_size % GROUP_SIZE or self.intermediate_size % GROUP_SIZE or self.local % 2:
            raise ValueError(
                f"MXFP4 experts: hidden_size {self.hidden_size} and intermediate_size "
                f"{self.intermediate_size} must be multiples of {GROUP_SIZE} (the scales' "
                f"groups), and each rank's expert width ({self.local}) even (two codes a byte)"
            )
        device = self.gate_up_proj.device
        del self.gate_up_proj, self.down_proj
        experts, hidden, local = self.num_experts, self.hidden_size, self.local
        # down_proj's inputs are this rank's slice of the width: where it does not fall on
        # whole groups (gpt-oss-120b's 2,880 over 4 or 8 ranks), the rank keeps every group
        # its slice touches and each input's group by index (g_idx).
        first = self.start // GROUP_SIZE
        num_groups = -(-(self.start + local) // GROUP_SIZE) - first
        self.down_groups = (first, num_groups)
        g_idx = None
        if self.start % GROUP_SIZE or local % GROUP_SIZE:
            offsets = torch.arange(local, device=device) + self.start % GROUP_SIZE
            g_idx = offsets // GROUP_SIZE  # [local] int64
        self.register_buffer("down_g_idx", g_idx, persistent=False)
        shapes = {
            "gate_up_proj_blocks": ((experts, 2 * local, hidden // 2), torch.uint8),
            "gate_up_proj_scales": ((experts, 2 * local, hidden // GROUP_SIZE), torch.float32),
            "down_proj_blocks": ((experts, hidden, local // 2), torch.uint8),
            "down_proj_scales": ((experts, hidden, num_groups), torch.float32),
        }
        for name, (shape, dtype) in shapes.items():
            param = nn.Parameter(
                torch.empty(shape, dtype=dtype, device=device), requires_grad=False
            )
            param.weight_loader = self.weight_loader
            self.register_parameter(name, param)
        self.is_packed = True

    def weight_loader(
        self, param: nn.Parameter, loaded: LazyTensor | torch.Tensor, shard: str | None = None
    ) -> None:
        """A checkpoint tensor of the tables above, whole; reads this rank's slice."""
        name = next(n for n, p in self.named_parameters(recurse=False) if p is param)
        loaded = as_lazy(loaded)
        experts, hidden, inter = self.num_experts, self.hidden_size, self.intermediate_size
        local, start, group = self.local, self.start, GROUP_SIZE
        expected = {
            "gate_up_proj": (experts, hidden, 2 * inter),
            "gate_up_proj_bias": (experts, 2 * inter),
            "down_proj": (experts, inter, hidden),
            "down_proj_bias": (experts, hidden),
            "gate_up_proj_blocks": (experts, 2 * inter, hidden // group, group // 2),
            "gate_up_proj_scales": (experts, 2 * inter, hidden // group),
            "down_proj_blocks": (experts, hidden, inter // group, group // 2),
            "down_proj_scales": (experts, hidden, inter // group),
        }[name]
        check_checkpoint_shape(loaded, expected, f"experts' {name}")
        if name == "gate_up_proj":  # [E, hidden, 2I]: this rank's columns, as rows
            mine = deinterleave(loaded.narrow(2, 2 * start, 2 * local), dim=2).transpose(1, 2)
        elif name == "down_proj":  # [E, I, hidden] -> [E, hidden, I / tp]
            mine = loaded.narrow(1, start, local).transpose(1, 2)
        elif name == "down_proj_bias":
            mine = loaded.load()
        elif name.startswith("gate_up_proj"):  # rows interleave gate and up: de-interleaved
            mine = deinterleave(loaded.narrow(1, 2 * start, 2 * local), dim=1)
        else:  # down_proj's codes or scales: the groups this rank's inputs fall in
            first, num_groups = self.down_groups
            mine = loaded.narrow(2, first, num_groups)
            if name.endswith("_blocks"):  # this rank's inputs' bytes (two codes a byte)
                mine = mine.flatten(2).narrow(2, (start - first * group) // 2, local // 2)
        if name.endswith("_blocks"):
            mine = mine.flatten(2)  # [E, out, in / 2]: two codes a byte, even input low
        elif name.endswith("_scales"):
            mine = e8m0_to_float(mine)
        param.data.copy_(mine)

    def _packed(self, expert: int) -> tuple[PackedWeight, PackedWeight]:
        """Expert `expert`'s MXFP4 (gate/up, down) weights, views of the packed tensors."""

        gate_up = PackedWeight(
            "fp4",
            self.gate_up_proj_blocks[expert],
            self.gate_up_proj_scales[expert],
            None,
            GROUP_SIZE,
            self.hidden_size,
        )
        down = PackedWeight(
            "fp4",
            self.down_proj_blocks[expert],
            self.down_proj_scales[expert],
            None,
            GROUP_SIZE,
            self.local,
            g_idx=self.down_g_idx,
        )
        return gate_up, down

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:  # [n, hidden]
        gate_up_bias = self.gate_up_proj_bias[expert]
        down_bias = self.down_proj_bias[expert] if self.is_first_rank else None
        if self.is_packed:
            gate_up_weight, down_weight = self._packed(expert)
            gate_up = kernels.quantized_linear(rows, gate_up_weight, gate_up_bias)
            hidden = clamped_swiglu(gate_up, self.alpha, self.limit)  # [n, I / tp]
            return kernels.quantized_linear(hidden, down_weight, down_bias)
        gate_up = F.linear(rows, self.gate_up_proj[expert], gate_up_bias)
        hidden = clamped_swiglu(gate_up, self.alpha, self.limit)  # [n, I / tp]
        return F.linear(hidden, self.down_proj[expert], down_bias)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:  # [T, hidden], this rank's partial sums
        return routed_experts(x, topk_weights, topk_ids, self.num_experts, self._expert)


class GptOssMoE(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.tp = get_tp_group()
        self.top_k = int(hf.num_experts_per_tok)
        self.router = ReplicatedLinear(config.hidden_size, int(hf.num_local_experts), bias=True)
        self.experts = GptOssExperts(hf, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden], reduced
        logits = self.router(x)  # [T, num_experts]
        top_logits, topk_ids = torch.topk(logits, self.top_k, dim=-1)
        topk_weights = torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype)
        return self.tp.all_reduce(self.experts(x, topk_weights, topk_ids))


class GptOssForCausalLM(LlamaForCausalLM):
    weight_spec = WeightSpec(
        packed=LLAMA_PACKED, renames=((".self_attn.sinks", ".self_attn.attn.sinks"),)
    )

    def make_attention(self, config: ArchConfig, layer: int) -> nn.Module:
        return LlamaAttention(config, layer, qkv_bias=True, sinks=True)  # o_proj biased too

    def make_mlp(self, config: ArchConfig, layer: int) -> nn.Module:
        return GptOssMoE(config)
