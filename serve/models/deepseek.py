"""DeepSeek-V2 and -V3 (and the checkpoints built on them: DeepSeek-R1, Kimi K2, Moonlight):
multi-head latent attention over a latent KV cache, and DeepSeek's mixture of experts.

Multi-head latent attention (MLA). Each token's keys and values for every head come out of
one compressed latent c = norm(W_DKV x) of `kv_lora_rank` channels, plus one rotated key
part k_pe of `qk_rope_head_dim` channels shared by all heads. `kv_b_proj` expands c into
each head's non-rotated key (W_UK) and its value (W_UV). Rather than caching the expanded
keys and values (heads x (192 + 128) numbers a token for V3), the cache holds [c | k_pe]
alone (576), and the expansion is folded into the query and the output ("absorbed"):

    q_h . k_h = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe     query: [W_UK_h^T q_nope_h | q_pe_h]
    o_h       = W_UV_h (sum_j p_j c_j)                       keys = values = [c | k_pe]

so attention runs as one KV head of kv_lora_rank + rope channels whose keys are also its
values (`Attention(shared_kv=True)`: one cache tensor a layer); of each head's output the
first kv_lora_rank channels are the weighted latent, which W_UV maps to the head's value.

| checkpoint module        | here                                                         |
|--------------------------|--------------------------------------------------------------|
| `q_proj` (no q LoRA)     | ColumnParallelLinear, split by heads                         |
| `q_a_proj`, `q_a_layernorm`, `q_b_proj` | replicated down-projection and norm; q_b by heads |
| `kv_a_proj_with_mqa`     | ReplicatedLinear -> [c | k_pe]; `kv_a_layernorm` normalises c |
| `kv_b_proj`              | ColumnParallelLinear by heads, read into W_UK / W_UV once     |
| `o_proj`                 | RowParallelLinear over this rank's heads' values              |

Tensor parallel: the query heads split over the ranks, the latent cache is every rank's
whole (each attends its own heads to it).

Mixture of experts (`DeepseekMoE`): layers from `first_k_dense_replace` on (every
`moe_layer_freq`-th) route each token to `num_experts_per_tok` of `n_routed_experts` and
always run the `n_shared_experts` (one MLP, ungated). The router scores in float32:

| version | scores  | expert choice                                             | weights                 |
|---------|---------|-----------------------------------------------------------|-------------------------|
| V2      | softmax | top-k (`greedy`), or within the `topk_group` groups of `n_group` with the best expert (`group_limited_greedy`) | renormalised iff `norm_topk_prob`, times `routed_scaling_factor` |
| V3      | sigmoid | top-k of score + `e_score_correction_bias` within the `topk_group` groups whose best two sum highest (`noaux_tc`) | the scores without the bias, likewise |
"""

from __future__ import annotations

import enum
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from serve.distributed.parallel_state import get_tp_group
from serve.kernels.reference import dequantize
from serve.models.arch_config import ArchConfig
from serve.models.layers.attention import Attention
from serve.models.layers.fused_moe import FusedMoE
from serve.models.layers.layernorm import RMSNorm
from serve.models.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from serve.models.layers.rotary import RotaryEmbedding, rope_parameters, yarn_mscale
from serve.models.llama import LlamaForCausalLM, LlamaMLP
from serve.models.moe import QWEN_EXPERTS
from serve.models.partition import split_evenly
from serve.models.weights import WeightSpec

# Only the MLPs' gate/up fuse; the attention projections keep their checkpoint names.
DEEPSEEK_PACKED = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

# The RMSNorms inside attention (q_a_layernorm, kv_a_layernorm) use their class default,
# not the config's rms_norm_eps, in DeepSeek's code and transformers' alike.
LATENT_NORM_EPS = 1e-6


def attention_scale(hf: Any) -> float:
    """1 / sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim)^2 when the rope is
    scaled (the long-context checkpoints)."""
    scale = (hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5
    rope = rope_parameters(hf)
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return scale


class MultiLatentAttention(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        hidden = config.hidden_size
        self.num_heads = split_evenly(
            config.num_heads, get_tp_group().world_size, "num_attention_heads"
        )  # this rank's
        self.nope_dim, self.rope_dim = int(hf.qk_nope_head_dim), int(hf.qk_rope_head_dim)
        self.v_dim, self.kv_lora_rank = int(hf.v_head_dim), int(hf.kv_lora_rank)
        qk_dim = self.nope_dim + self.rope_dim
        bias = bool(getattr(hf, "attention_bias", False))
        self.q_lora_rank = hf.q_lora_rank
        if self.q_lora_rank is None:  # V2-Lite
            self.q_proj = ColumnParallelLinear(hidden, config.num_heads * qk_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, config.num_heads * qk_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope_dim, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, config.num_heads * (self.nope_dim + self.v_dim)
        )
        self.kv_b_proj.takes_lora = False  # never run: read into W_UK and W_UV (below)
        self.o_proj = RowParallelLinear(config.num_heads * self.v_dim, hidden, bias)
        # V2 rotates interleaved pairs (x0, x1), (x2, x3), ...; V3 too unless `rope_interleave`
        # is false. transformers' V3 writes the rotated pairs back de-interleaved, a permutation
        # that queries and keys share, so their products are the same.
        interleaved = bool(getattr(hf, "rope_interleave", True))
        self.rotary_emb = RotaryEmbedding(
            self.rope_dim,
            config.max_position,
            rope_parameters(hf),
            self.rope_dim,
            is_neox_style=not interleaved,
        )
        self.attn = Attention(
            self.num_heads,
            self.kv_lora_rank + self.rope_dim,
            1,
            attention_scale(hf),
            shared_kv=True,
        )
        # (W_UK [heads, nope, kv_lora], W_UV^T [heads, kv_lora, v]), read from kv_b_proj's
        # loaded weight at the first forward.
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def absorbed(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._absorbed is None:
            packed = self.kv_b_proj.packed_weight  # a quantized checkpoint's
            weight = self.kv_b_proj.weight if packed is None else dequantize(packed, dtype)
            per_head = weight.detach().view(self.num_heads, self.nope_dim + self.v_dim, -1)
            w_uk = per_head[:, : self.nope_dim].contiguous()  # [heads, nope, kv_lora]
            w_uv = per_head[:, self.nope_dim :].transpose(1, 2).contiguous()  # [heads, kv_lora, v]
            self._absorbed = (w_uk, w_uv)
        return self._absorbed

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        num_tokens, heads = x.shape[0], self.num_heads
        nope, kv_lora = self.nope_dim, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, heads, nope + self.rope_dim)
        latent = self.kv_a_proj_with_mqa(x)  # [T, kv_lora + rope]
        c_kv = self.kv_a_layernorm(latent[:, :kv_lora].contiguous())  # [T, kv_lora]
        q_pe, k_pe = self.rotary_emb(
            positions,
            q[..., nope:].contiguous(),  # [T, heads, rope]
            latent[:, None, kv_lora:].contiguous(),  # [T, 1, rope]
        )
        w_uk, w_uv = self.absorbed(x.dtype)
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w_uk)  # [heads, T, kv_lora]
        query = torch.cat((q_latent.transpose(0, 1), q_pe), dim=-1)  # [T, heads, kv_lora + rope]
        key = torch.cat((c_kv[:, None, :], k_pe), dim=-1)  # [T, 1, kv_lora + rope]
        out = self.attn(query, key, None).view(num_tokens, heads, -1)[..., :kv_lora]
        values = torch.bmm(out.transpose(0, 1), w_uv)  # [heads, T, v]
        return self.o_proj(values.transpose(0, 1).reshape(num_tokens, heads * self.v_dim))


class GroupScore(enum.Enum):
    """How a group of experts is scored for group-limited routing, by `topk_method`."""

    BEST_EXPERT = "group_limited_greedy"  # V2: the group's best expert
    BEST_TWO = "noaux_tc"  # V3: its best two, summed


def deepseek_route(
    router_logits: torch.Tensor,  # [T, num_experts] float32
    top_k: int,
    *,
    scoring: str,  # "softmax" (V2) or "sigmoid" (V3)
    group_score: GroupScore | None,  # None: top-k over all experts (`greedy`)
    num_groups: int,
    topk_groups: int,
    correction_bias: torch.Tensor | None,  # [num_experts] float32, V3
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, top_k] float32 weights, [T, top_k] int64 ids)
    """DeepSeek's routing in transformers' order of operations (the table above)."""
    if scoring == "softmax":
        scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    elif scoring == "sigmoid":
        scores = router_logits.sigmoid()
    else:
        raise ValueError(f"scoring_func {scoring!r}: DeepSeek routes by softmax or sigmoid")
    choice = scores if correction_bias is None else scores + correction_bias
    if group_score is not None:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
        if group_score is GroupScore.BEST_TWO:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_ids = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, -1)
        # V3 sets the other groups' experts to -inf, V2 to 0: either way none is chosen.
        fill = float("-inf") if group_score is GroupScore.BEST_TWO else 0.0
        choice = choice.masked_fill(~expert_mask.bool(), fill)
    topk_ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * scaling, topk_ids


class DeepseekRouter(nn.Module):
    """The router's float32 weight [num_experts, hidden] (and V3's correction bias): the
    logits are computed in float32 whatever the model's dtype, as in transformers."""

    def __init__(self, hf: Any, hidden_size: int, sigmoid: bool) -> None:
        super().__init__()
        num_experts = int(hf.n_routed_experts)
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.weight.weight_loader = default_weight_loader
        self.e_score_correction_bias = None
        if sigmoid:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False
            )
            self.e_score_correction_bias.weight_loader = default_weight_loader
        self.top_k = int(hf.num_experts_per_tok)
        self.scoring = getattr(hf, "scoring_func", None) or ("sigmoid" if sigmoid else "softmax")
        method = getattr(hf, "topk_method", None) or ("noaux_tc" if sigmoid else "greedy")
        methods = ["greedy", *(score.value for score in GroupScore)]
        if method not in methods:
            raise ValueError(f"topk_method {method!r}: supported {', '.join(methods)}")
        self.group_score = None if method == "greedy" else GroupScore(method)
        self.num_groups = int(getattr(hf, "n_group", None) or 1)
        self.topk_groups = int(getattr(hf, "topk_group", None) or 1)
        if num_experts % self.num_groups:
            raise ValueError(
                f"n_group {self.num_groups} must divide n_routed_experts {num_experts}"
            )
        self.renormalize = bool(getattr(hf, "norm_topk_prob", False)) and self.top_k > 1
        self.scaling = float(getattr(hf, "routed_scaling_factor", None) or 1.0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(x.float(), self.weight)  # [T, num_experts]
        return deepseek_route(
            logits,
            self.top_k,
            scoring=self.scoring,
            group_score=self.group_score,
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
            correction_bias=self.e_score_correction_bias,
            renormalize=self.renormalize,
            scaling=self.scaling,
        )


class DeepseekMoE(nn.Module):
    """Routed experts plus the always-on shared experts, one all-reduce at the end."""

    def __init__(self, config: ArchConfig, sigmoid: bool) -> None:
        super().__init__()
        hf = config.hf
        if hf.hidden_act not in ("silu", "swish"):
            raise ValueError(f"MoE experts support the silu activation, got {hf.hidden_act!r}.")
        self.tp = get_tp_group()
        self.gate = DeepseekRouter(hf, config.hidden_size, sigmoid)
        self.experts = FusedMoE(
            int(hf.n_routed_experts), config.hidden_size, int(hf.moe_intermediate_size)
        )
        num_shared = int(getattr(hf, "n_shared_experts", None) or 0)
        self.shared_experts = None
        if num_shared:
            self.shared_experts = LlamaMLP(
                config.hidden_size,
                int(hf.moe_intermediate_size) * num_shared,
                hf.hidden_act,
                bool(getattr(hf, "mlp_bias", False)),
                reduce_results=False,  # reduced with the routed experts
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden], reduced
        topk_weights, topk_ids = self.gate(x)
        out = self.experts(x, topk_weights, topk_ids)  # [T, hidden], partial
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)


def is_moe_layer(hf: Any, layer: int) -> bool:
    first_sparse = int(getattr(hf, "first_k_dense_replace", None) or 0)
    every = int(getattr(hf, "moe_layer_freq", None) or 1)
    return (
        bool(getattr(hf, "n_routed_experts", None)) and layer >= first_sparse and layer % every == 0
    )


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """The Llama decoder (pre-norm blocks, RMSNorm, SwiGLU dense layers) with MLA and
    DeepSeek's MoE swapped in."""

    sigmoid_router = False
    weight_spec = WeightSpec(packed=DEEPSEEK_PACKED, experts=QWEN_EXPERTS)

    def __init__(self, config: ArchConfig) -> None:
        super().__init__(config)
        # V3's multi-token-prediction layers follow the last layer in the checkpoint; they
        # serve speculative decoding in DeepSeek's own stack, not this model's forward.
        hf = config.hf
        extra = int(getattr(hf, "num_nextn_predict_layers", None) or 0)
        skipped = tuple(rf"^model\.layers\.{config.num_layers + i}\." for i in range(extra))
        self.weight_spec = replace(self.weight_spec, ignored=(*self.weight_spec.ignored, *skipped))

    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        layers = range(int(hf.num_hidden_layers))
        sizes = {}
        if any(not is_moe_layer(hf, i) for i in layers):
            sizes["intermediate_size"] = int(hf.intermediate_size)
        if any(is_moe_layer(hf, i) for i in layers):
            sizes["moe_intermediate_size"] = int(hf.moe_intermediate_size)
            shared = int(getattr(hf, "n_shared_experts", None) or 0)
            if shared:
                sizes["shared experts' width"] = int(hf.moe_intermediate_size) * shared
        heads = int(hf.num_attention_heads)
        return ArchConfig.from_hf(
            hf,
            architecture,
            # MLA's cache is one latent per token, whole at every rank: no KV heads to split.
            num_kv_heads=heads,
            head_dim=int(hf.qk_nope_head_dim) + int(hf.qk_rope_head_dim),
            split_sizes=sizes,
        )

    def make_attention(self, config: ArchConfig, layer: int) -> nn.Module:
        return MultiLatentAttention(config)

    def make_mlp(self, config: ArchConfig, layer: int) -> nn.Module | None:
        if not is_moe_layer(config.hf, layer):
            return None  # the dense MLP, `intermediate_size` wide
        return DeepseekMoE(config, self.sigmoid_router)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    sigmoid_router = True  # sigmoid scores, a correction bias, groups by their best two
