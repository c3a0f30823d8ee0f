"""The Llama family (Llama 1/2/3, Mistral, Qwen2, Qwen3) over a flat token stream of the
whole batch.

Tensor parallel (Megatron style): each rank holds its share of the attention heads and of
the MLP's intermediate columns, and one all-reduce closes each attention block and each
MLP; norms and residuals are replicated. At one rank every layer is a plain one.

Variants are constructor flags: q/k/v biases (Qwen2, `attention_bias`), per-head q/k
RMSNorm (Qwen3), a sliding window per layer (Mistral, Qwen2's `layer_types`). The
remote-code formats built on it (internlm.py, baichuan.py, qwen.py) normalise their configs
into these names, plus ALiBi (`alibi`) and partial rotary (`rotary_pct`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from serve.distributed.parallel_state import get_tp_group
from serve.models.arch_config import ArchConfig
from serve.models.layers.activation import ActAndMul
from serve.models.layers.attention import Attention, alibi_slopes
from serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from serve.models.layers.layernorm import RMSNorm
from serve.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from serve.models.layers.rotary import RotaryEmbedding, rope_parameters
from serve.models.weights import WeightSpec

LLAMA_PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ArchConfig, layer: int, qkv_bias: bool, qk_norm: bool = False
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
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, o_bias)
        # Qwen3: RMSNorm over each head's q and k, before the rotation.
        self.q_norm = RMSNorm(self.head_dim, hf.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, hf.rms_norm_eps) if qk_norm else None
        # Set only by the remote-code formats' configs (transformers' Llama reads neither):
        # Baichuan 13B's ALiBi instead of rotary positions (`alibi`, as Falcon spells it), and
        # Qwen v1's rotation of the first `rotary_pct` of each head.
        is_alibi = bool(getattr(hf, "alibi", False))
        rotary_dim = int(self.head_dim * getattr(hf, "rotary_pct", 1.0))
        self.rotary_emb = None
        if not is_alibi:
            self.rotary_emb = RotaryEmbedding(
                self.head_dim, config.max_position, rope_parameters(hf), rotary_dim
            )
        slopes = None
        if is_alibi:  # this rank's heads' slopes
            first_head = get_tp_group().rank * self.num_heads
            slopes = alibi_slopes(config.num_heads)[first_head : first_head + self.num_heads]
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            self.head_dim**-0.5,
            alibi_slopes=slopes,
            sliding_window=config.sliding_windows[layer],
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
        mlp: nn.Module | None = None,  # None: the dense gated MLP
    ) -> None:
        super().__init__()
        hf = config.hf
        self.self_attn = LlamaAttention(config, layer, qkv_bias, qk_norm)
        self.mlp = mlp if mlp is not None else LlamaMLP(
            config.hidden_size,
            hf.intermediate_size,
            getattr(hf, "hidden_act", "silu"),
            bool(getattr(hf, "mlp_bias", False)),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ArchConfig,
        qkv_bias: bool,
        qk_norm: bool,
        make_mlp: Callable[[int], nn.Module | None] = lambda layer: None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias, qk_norm, make_mlp(i))
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.hf.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    weight_spec = WeightSpec(packed=LLAMA_PACKED)

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        qkv_bias = self.qkv_bias or bool(getattr(hf, "attention_bias", False))
        qkv_bias = qkv_bias or bool(getattr(hf, "qkv_bias", False))  # Qwen2-MoE's name
        self.model = LlamaModel(config, qkv_bias, self.qk_norm, lambda i: self.make_mlp(config, i))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config.hf, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, config: ArchConfig, layer: int) -> nn.Module | None:
        """Layer `layer`'s MLP; None: the dense gated MLP. The MoE families (moe.py) return
        their sparse blocks here."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] on rank 0, None on the other ranks. A collective:
        every rank calls it, with the same N."""
        return self.lm_head(hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True  # Qwen2 always has q/k/v biases, no o_proj bias


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True  # per-head RMSNorm of q and k; biases only with `attention_bias`
