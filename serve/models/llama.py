"""The Llama family (Llama 1/2/3, Mistral, Qwen2, Qwen3, Granite, Phi-3) over a flat token
stream of the whole batch.

Tensor parallel (Megatron style): each rank holds its share of the attention heads and of
the MLP's intermediate columns, and one all-reduce closes each attention block and each
MLP; norms and residuals are replicated. At one rank every layer is a plain one.

Variants are constructor flags: q/k/v biases (Qwen2, `attention_bias`), per-head q/k
RMSNorm (Qwen3), a sliding window per layer (Mistral, Qwen2's `layer_types`), Granite's
four multipliers (`Multipliers`), and Phi-3's fused checkpoint tensors and LongRoPE (a rope
type, rotary.py). Partial rotary (`partial_rotary_factor`) rotates the first part of each head.
Mixture-of-experts models (moe.py) swap the MLP per layer (`make_mlp`). The remote-code
formats built on it (internlm.py, baichuan.py, qwen.py) normalise their configs into these
names, plus ALiBi (`alibi`) and Qwen v1's partial rotary (`rotary_pct`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from serve.distributed.parallel_state import get_tp_group
from serve.models.arch_config import ArchConfig
from serve.models.layers.activation import ActAndMul
from serve.models.layers.attention import Attention, alibi_slopes
from serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from serve.models.layers.layernorm import RMSNorm, norm_adding
from serve.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from serve.models.layers.rotary import get_rope, rope_parameters
from serve.models.native_layer_stack import LayerRunner
from serve.models.weights import FusedRows, WeightSpec

LLAMA_PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


@dataclass(frozen=True)
class Multipliers:
    """Granite's scalars; Llama's are the identity."""

    embedding: float = 1.0  # the token embeddings are multiplied by it
    attention: float | None = None  # the attention scale (None: head_dim ** -0.5)
    residual: float = 1.0  # each block's output is multiplied by it before the residual add
    logits: float = 1.0  # the logits are divided by it (`logits_scaling`)

    @classmethod
    def from_hf(cls, hf: Any) -> Multipliers:
        return cls(
            float(hf.embedding_multiplier),
            float(hf.attention_multiplier),
            float(hf.residual_multiplier),
            float(hf.logits_scaling),
        )


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ArchConfig,
        layer: int,
        qkv_bias: bool,
        qk_norm: bool = False,
        scale: float | None = None,
        sinks: bool = False,  # GPT-OSS's learned per-head sink logits (layers/attention.py)
    ) -> None:
        super().__init__()
        hf = config.hf
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads, qkv_bias
        )
        # This rank's heads: attention and its KV cache hold only these.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        o_bias = bool(getattr(hf, "attention_bias", False))
        self.o_proj = RowParallelLinear(
            config.num_heads * self.head_dim, config.hidden_size, o_bias
        )
        # Qwen3: RMSNorm over each head's q and k, before the rotation.
        self.q_norm = RMSNorm(self.head_dim, hf.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, hf.rms_norm_eps) if qk_norm else None
        # Set only by the remote-code formats' configs (transformers' Llama reads neither):
        # Baichuan 13B's ALiBi instead of rotary positions (`alibi`, as Falcon spells it), and
        # Qwen v1's rotation of the first `rotary_pct` of each head.
        is_alibi = bool(getattr(hf, "alibi", False))
        rope = rope_parameters(hf)
        rotary_fraction = rope.get("partial_rotary_factor", getattr(hf, "rotary_pct", 1.0))
        rotary_dim = int(self.head_dim * rotary_fraction)
        self.rotary_emb = None
        if not is_alibi:
            self.rotary_emb = get_rope(self.head_dim, config.max_position, rope, rotary_dim)
        slopes = None
        if is_alibi:  # this rank's heads' slopes
            first_head = get_tp_group().rank * self.num_heads
            slopes = alibi_slopes(config.num_heads)[first_head : first_head + self.num_heads]
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            self.head_dim**-0.5 if scale is None else scale,
            alibi_slopes=slopes,
            sliding_window=config.sliding_windows[layer],
            sinks=sinks,
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
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))  # [T, hidden], reduced over ranks


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str,
        bias: bool,
        reduce_results: bool = True,  # False: partial sums, for a MoE block's shared expert
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, ["gate", "up"], bias
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, reduce_results)
        self.act = ActAndMul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> [T, 2 * inter / tp] -> [T, inter / tp] -> [T, hidden], reduced
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ArchConfig,
        layer: int,
        qkv_bias: bool,
        qk_norm: bool,
        mult: Multipliers,
        mlp: nn.Module | None = None,  # None: the dense gated MLP
        attention: nn.Module | None = None,  # None: LlamaAttention
    ) -> None:
        super().__init__()
        hf = config.hf
        self.self_attn = (
            attention
            if attention is not None
            else LlamaAttention(config, layer, qkv_bias, qk_norm, mult.attention)
        )
        self.residual_multiplier = mult.residual
        self.mlp = (
            mlp
            if mlp is not None
            else LlamaMLP(
                config.hidden_size,
                hf.intermediate_size,
                getattr(hf, "hidden_act", "silu"),
                bool(getattr(hf, "mlp_bias", False)),
            )
        )
        self.input_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = norm_adding(self.input_layernorm, x, residual)
        x = self.self_attn(positions, x)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        return x, residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ArchConfig,
        qkv_bias: bool,
        qk_norm: bool,
        mult: Multipliers,
        make_mlp: Callable[[int], nn.Module | None] = lambda layer: None,
        make_attention: Callable[[int], nn.Module | None] = lambda layer: None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_multiplier = mult.embedding
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias, qk_norm, mult, make_mlp(i), make_attention(i))
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.hf.rms_norm_eps)
        self.run_layers = LayerRunner()  # on CPU, the layers in one native call

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        x, residual = self.run_layers(self.layers, positions, x)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    weight_spec = WeightSpec(packed=LLAMA_PACKED)

    has_multipliers = False

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        qkv_bias = self.qkv_bias or bool(getattr(hf, "attention_bias", False))
        qkv_bias = qkv_bias or bool(getattr(hf, "qkv_bias", False))  # Qwen2-MoE's name
        mult = Multipliers.from_hf(hf) if self.has_multipliers else Multipliers()
        self.logits_divisor = mult.logits
        self.model = LlamaModel(
            config,
            qkv_bias,
            self.qk_norm,
            mult,
            lambda i: self.make_mlp(config, i),
            lambda i: self.make_attention(config, i),
        )
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config.hf, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, config: ArchConfig, layer: int) -> nn.Module | None:
        """Layer `layer`'s MLP; None: the dense gated MLP. The MoE families (moe.py) return
        their sparse blocks here."""
        return None

    def make_attention(self, config: ArchConfig, layer: int) -> nn.Module | None:
        """Layer `layer`'s attention block, `forward(positions, x) -> [T, hidden]` reduced;
        None: LlamaAttention. DeepSeek's multi-head latent attention comes in here."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] on rank 0, None on the other ranks. A collective:
        every rank calls it, with the same N."""
        logits = self.lm_head(hidden)
        if logits is None or self.logits_divisor == 1.0:
            return logits
        return logits / self.logits_divisor


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True  # Qwen2 always has q/k/v biases, no o_proj bias


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True  # per-head RMSNorm of q and k; biases only with `attention_bias`


class GraniteForCausalLM(LlamaForCausalLM):
    has_multipliers = True  # embedding, attention scale, residual, logits (Multipliers)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v and gate/up fused in the checkpoint (plain concatenation: FusedRows
    lets each rank read only its rows) and LongRoPE (rotary.py) when the config asks."""

    def __init__(self, config: ArchConfig) -> None:
        super().__init__(config)
        q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        inter = config.hf.intermediate_size
        self.weight_spec = WeightSpec(
            fused={
                "qkv_proj": FusedRows((("q", q_rows), ("k", kv_rows), ("v", kv_rows))),
                "gate_up_proj": FusedRows((("gate", inter), ("up", inter))),
            }
        )
