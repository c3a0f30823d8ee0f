"""Mixture-of-experts families on the Llama decoder: Mixtral, Qwen2-MoE, Qwen3-MoE.

Attention is the Llama family's (Mistral's sliding window, Qwen2's q/k/v biases, Qwen3's
per-head q/k RMSNorm); the MLP of a sparse layer is a `SparseMoeBlock` (layers/fused_moe.py).

| family    | routing weights                          | shared expert       | dense layers                |
|-----------|------------------------------------------|---------------------|-----------------------------|
| Mixtral   | top-k renormalised, kept in float32      | none                | none                        |
| Qwen2-MoE | renormalised iff `norm_topk_prob`, cast  | sigmoid-gated MLP   | `mlp_only_layers`, `decoder_sparse_step` |
| Qwen3-MoE | renormalised iff `norm_topk_prob`, cast  | none                | `mlp_only_layers`, `decoder_sparse_step` |
"""

from __future__ import annotations

from typing import Any

from torch import nn

from serve.models.arch_config import ArchConfig
from serve.models.layers.fused_moe import SparseMoeBlock
from serve.models.llama import LLAMA_PACKED, LlamaForCausalLM, LlamaMLP
from serve.models.weights import ExpertTensors, WeightSpec

QWEN_EXPERTS = ExpertTensors(
    {
        "gate_proj": ("w13_weight", "gate"),
        "up_proj": ("w13_weight", "up"),
        "down_proj": ("w2_weight", "down"),
    }
)


def is_sparse_layer(hf: Any, layer: int) -> bool:
    """Qwen-MoE's rule, as transformers builds its decoder layers."""
    return (
        layer not in (getattr(hf, "mlp_only_layers", None) or [])
        and hf.num_experts > 0
        and (layer + 1) % hf.decoder_sparse_step == 0
    )


class MixtralForCausalLM(LlamaForCausalLM):
    weight_spec = WeightSpec(
        packed=LLAMA_PACKED,
        experts=ExpertTensors(
            {"w1": ("w13_weight", "gate"), "w3": ("w13_weight", "up"), "w2": ("w2_weight", "down")}
        ),
        renames=((".block_sparse_moe.", ".mlp."),),
    )

    def make_mlp(self, config: ArchConfig, layer: int) -> nn.Module:
        hf = config.hf
        return SparseMoeBlock(
            config.hidden_size,
            hf.num_local_experts,
            hf.num_experts_per_tok,
            hf.intermediate_size,
            renormalize=True,
            float32_weights=True,
            hidden_act=hf.hidden_act,
        )


class QwenMoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE and Qwen3-MoE: sparse layers by `is_sparse_layer`, dense ones between."""

    has_shared_expert = False
    weight_spec = WeightSpec(packed=LLAMA_PACKED, experts=QWEN_EXPERTS)

    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        """The widths a tensor-parallel split must divide: the experts', the shared
        expert's, and the dense MLP's only where some layer has one."""
        sizes = {"moe_intermediate_size": int(hf.moe_intermediate_size)}
        if cls.has_shared_expert:
            sizes["shared_expert_intermediate_size"] = int(hf.shared_expert_intermediate_size)
        if not all(is_sparse_layer(hf, i) for i in range(hf.num_hidden_layers)):
            sizes["intermediate_size"] = int(hf.intermediate_size)
        return ArchConfig.from_hf(hf, architecture, split_sizes=sizes)

    def make_mlp(self, config: ArchConfig, layer: int) -> nn.Module | None:
        hf = config.hf
        if not is_sparse_layer(hf, layer):
            return None  # the dense MLP, `intermediate_size` wide
        shared_expert = None
        if self.has_shared_expert:
            shared_expert = LlamaMLP(
                config.hidden_size,
                hf.shared_expert_intermediate_size,
                hf.hidden_act,
                bias=False,
                reduce_results=False,  # the block reduces it with the routed experts
            )
        return SparseMoeBlock(
            config.hidden_size,
            hf.num_experts,
            hf.num_experts_per_tok,
            hf.moe_intermediate_size,
            renormalize=bool(hf.norm_topk_prob),
            hidden_act=hf.hidden_act,
            shared_expert=shared_expert,
        )


class Qwen2MoeForCausalLM(QwenMoeForCausalLM):
    has_shared_expert = True  # q/k/v biases come from the config's `qkv_bias`


class Qwen3MoeForCausalLM(QwenMoeForCausalLM):
    qk_norm = True  # q/k/v (and o) biases only with `attention_bias`
