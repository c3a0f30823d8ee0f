"""Gemma 2 and Gemma 3 (text) over a flat token stream of the whole batch.

What sets them apart from Llama, all as transformers computes it:
- RMSNorm scales by (1 + w) (RMSNorm's `weight_offset`), and every block is a sandwich:
  a norm before attention and the MLP, and another on their outputs before the residual add.
- The embeddings are multiplied by sqrt(hidden) rounded to the model's dtype.
- The attention scale is `query_pre_attn_scalar ** -0.5`, not head_dim's.
- Local (sliding-window) and global layers alternate (`layer_types`).
- The MLP is GeGLU (`hidden_activation`, gelu with the tanh approximation).
- Soft-caps: c * tanh(x / c) on the attention scores (Gemma 2's `attn_logit_softcapping`)
  and on the final logits (`final_logit_softcapping`).
- Gemma 3 adds a per-head RMSNorm of q and k, and a rope base (and scaling) per layer type
  (`rope_parameters[layer_type]`). transformers 5 passes no soft-cap to Gemma 3's attention
  whatever its config says, so neither do we.

Tensor parallel as Llama: heads and MLP columns split, norms replicated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from serve.models.arch_config import ArchConfig
from serve.models.layers.attention import Attention
from serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from serve.models.layers.layernorm import RMSNorm, norm_adding
from serve.models.layers.linear import QKVParallelLinear, RowParallelLinear
from serve.models.layers.rotary import RotaryEmbedding, rope_parameters
from serve.models.llama import LLAMA_PACKED, LlamaMLP
from serve.models.native_layer_stack import LayerRunner
from serve.models.weights import WeightSpec


def _gemma_norm(size: int, hf: Any) -> RMSNorm:
    return RMSNorm(size, hf.rms_norm_eps, weight_offset=1.0)


def _layer_rope(hf: Any, layer_type: str) -> dict[str, Any]:
    """This layer type's rope settings: Gemma 3 keeps one dict per layer type (transformers
    5 moves `rope_local_base_freq` there); Gemma 2 has one for all layers."""
    per_type = getattr(hf, "rope_parameters", None) or {}
    if not isinstance(per_type.get(layer_type), dict):
        return rope_parameters(hf)
    params = dict(per_type[layer_type])
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


class GemmaAttention(nn.Module):
    def __init__(self, config: ArchConfig, layer: int, qk_norm: bool, attn_softcap: bool) -> None:
        super().__init__()
        hf = config.hf
        self.head_dim = config.head_dim
        bias = bool(getattr(hf, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads, bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, bias)
        self.q_norm = _gemma_norm(self.head_dim, hf) if qk_norm else None
        self.k_norm = _gemma_norm(self.head_dim, hf) if qk_norm else None
        layer_type = hf.layer_types[layer]
        rope = _layer_rope(hf, layer_type)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position, rope)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            float(hf.query_pre_attn_scalar) ** -0.5,
            sliding_window=config.sliding_windows[layer],
            logit_softcap=getattr(hf, "attn_logit_softcapping", None) if attn_softcap else None,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # This rank's heads: [T, num_heads * head_dim], [T, num_kv_heads * head_dim] x 2
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))  # [T, hidden], reduced over ranks


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig, layer: int, qk_norm: bool, attn_softcap: bool) -> None:
        super().__init__()
        hf = config.hf
        self.self_attn = GemmaAttention(config, layer, qk_norm, attn_softcap)
        act = getattr(hf, "hidden_activation", None) or hf.hidden_act
        self.mlp = LlamaMLP(config.hidden_size, hf.intermediate_size, act, bias=False)
        self.input_layernorm = _gemma_norm(config.hidden_size, hf)
        self.post_attention_layernorm = _gemma_norm(config.hidden_size, hf)
        self.pre_feedforward_layernorm = _gemma_norm(config.hidden_size, hf)
        self.post_feedforward_layernorm = _gemma_norm(config.hidden_size, hf)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The layer's input is x + residual (the previous layer left the add to this norm).
        x, residual = norm_adding(self.input_layernorm, x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(self, config: ArchConfig, qk_norm: bool, attn_softcap: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # sqrt(hidden) in float32, then in the model's dtype, as transformers rounds it.
        normalizer = torch.tensor(config.hidden_size**0.5, dtype=torch.float32)
        self.register_buffer("normalizer", normalizer, persistent=False)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, qk_norm, attn_softcap) for i in range(config.num_layers)
        )
        self.norm = _gemma_norm(config.hidden_size, config.hf)
        self.run_layers = LayerRunner()  # on CPU, the layers in one native call

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        x, residual = self.run_layers(self.layers, positions, x * self.normalizer.to(x.dtype))
        x, _ = self.norm(x, residual)
        return x


class Gemma2ForCausalLM(nn.Module):
    qk_norm = False
    attn_softcap = True
    weight_spec = WeightSpec(packed=LLAMA_PACKED)

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError("bidirectional Gemma (an embedding model) is not a causal LM.")
        self.model = GemmaModel(config, self.qk_norm, self.attn_softcap)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(hf, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_softcap = getattr(hf, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] on rank 0 (soft-capped), None on the other ranks."""
        logits = self.lm_head(hidden)
        if logits is None or not self.final_softcap:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    attn_softcap = False  # transformers 5's Gemma 3 attention takes no soft-cap
