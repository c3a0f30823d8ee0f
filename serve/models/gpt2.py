"""GPT-2 and GPT-BigCode (StarCoder, SantaCoder): pre-LayerNorm blocks over learned
absolute positions, one fused `c_attn` projection with bias, a plain MLP, a tied head.

They differ only in how `c_attn` lays out q, k and v and in their attention scale:

| family               | c_attn rows (checkpoint)                   | stored    | KV heads |
|----------------------|--------------------------------------------|-----------|----------|
| GPT-2                | q (hidden), k (hidden), v (hidden)         | [in, out] | = heads  |
| BigCode, multi_query | q (hidden), k (head_dim), v (head_dim)     | [out, in] | 1        |
| BigCode, MHA         | per head: q, k, v (head_dim each)          | [out, in] | = heads  |

Tensor parallel: heads split (BigCode's single KV head is replicated on every rank), the
MLP splits its inner columns, the position table is replicated.

Checkpoints name the body `transformer.*`, or bare (`h.0.attn...`, openai-community/gpt2):
both reach the same parameters, which sit at the top of the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from serve.models.arch_config import ArchConfig
from serve.models.layers.activation import Activation
from serve.models.layers.attention import Attention
from serve.models.layers.embedding import (
    ParallelLMHead,
    ReplicatedEmbedding,
    VocabParallelEmbedding,
)
from serve.models.layers.layernorm import LayerNorm, norm_adding
from serve.models.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from serve.models.native_layer_stack import LayerRunner
from serve.models.weights import FusedRows, WeightSpec

# Causal-mask buffers of old checkpoints; cross-attention, which a decoder-only forward
# (no encoder states) never runs.
_IGNORED = (r"(^|\.)attn\.(bias|masked_bias)$", r"\.crossattention\.", r"\.ln_cross_attn\.")


def inner_size(hf: Any) -> int:
    """The MLP width: `n_inner`, or four times the hidden size (GPT-2, BigCode, GPT-J)."""
    return hf.n_inner if hf.n_inner is not None else 4 * hf.hidden_size


class GPT2Attention(nn.Module):
    def __init__(self, config: ArchConfig, scale: float) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.c_attn = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads, bias=True
        )
        # This rank's heads: attention and its KV cache hold only these.
        self.num_heads, self.num_kv_heads = self.c_attn.num_heads, self.c_attn.num_kv_heads
        self.c_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, True)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # This rank's heads: [T, num_heads * head_dim], [T, num_kv_heads * head_dim] x 2
        q, k, v = self.c_attn.split(self.c_attn(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.c_proj(self.attn(q, k, v))  # [T, hidden], reduced over ranks


class GPT2MLP(nn.Module):
    def __init__(self, hidden_size: int, inner_size: int, act: str) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(hidden_size, inner_size, bias=True)
        self.act = Activation(act)
        self.c_proj = RowParallelLinear(inner_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> [T, inner / tp] -> [T, hidden], reduced
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: ArchConfig, scale: float) -> None:
        super().__init__()
        hf = config.hf
        self.ln_1 = LayerNorm(config.hidden_size, hf.layer_norm_epsilon)
        self.attn = GPT2Attention(config, scale)
        self.ln_2 = LayerNorm(config.hidden_size, hf.layer_norm_epsilon)
        self.mlp = GPT2MLP(config.hidden_size, inner_size(hf), hf.activation_function)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        del positions  # the model added them to the embeddings (LayerRunner passes them on)
        x, residual = norm_adding(self.ln_1, x, residual)
        x = self.attn(x)
        x, residual = self.ln_2(x, residual)
        return self.mlp(x), residual


class GPT2LMHeadModel(nn.Module):
    """The GPT-2 body (wte, wpe, h, ln_f) and its head, as one module: checkpoint names
    with or without the `transformer.` prefix land here."""

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.weight_spec = self.checkpoint_layout(config)
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = ReplicatedEmbedding(config.max_position, config.hidden_size)
        self.h = nn.ModuleList(
            GPT2Block(config, self.attention_scale(hf, config.head_dim, i))
            for i in range(config.num_layers)
        )
        self.ln_f = LayerNorm(config.hidden_size, hf.layer_norm_epsilon)
        self.run_layers = LayerRunner()  # on CPU, the blocks in one native call
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if hf.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        num_heads = hf.num_attention_heads
        return ArchConfig.from_hf(
            hf,
            architecture,
            num_kv_heads=cls.num_kv_heads(hf),
            head_dim=hf.hidden_size // num_heads,
            split_sizes={"n_inner": inner_size(hf)},
        )

    @classmethod
    def num_kv_heads(cls, hf: Any) -> int:
        return hf.num_attention_heads

    @classmethod
    def attention_scale(cls, hf: Any, head_dim: int, layer: int) -> float:
        scale = head_dim**-0.5 if hf.scale_attn_weights else 1.0
        # `reorder_and_upcast_attn` only changes mixed-precision arithmetic: nothing here.
        if hf.scale_attn_by_inverse_layer_idx:
            scale /= float(layer + 1)
        return scale

    @classmethod
    def checkpoint_layout(cls, config: ArchConfig) -> WeightSpec:
        hidden = config.hidden_size
        return WeightSpec(
            fused={"c_attn": FusedRows((("q", hidden), ("k", hidden), ("v", hidden)))},
            transposed=("c_attn", "c_proj", "c_fc"),  # Conv1D: [in, out]
            renames=(("transformer.", ""),),
            ignored=_IGNORED,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.wte(input_ids) + self.wpe(positions), None  # [T, hidden]
        x, residual = self.run_layers(self.h, positions, x)
        x, _ = self.ln_f(x, residual)
        return x  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] on rank 0, None on the other ranks. A collective:
        every rank calls it, with the same N."""
        return self.lm_head(hidden)


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    """GPT-2's blocks with nn.Linear weights ([out, in]) and multi-query attention (one
    KV head) unless `multi_query` is False."""

    @classmethod
    def num_kv_heads(cls, hf: Any) -> int:
        return 1 if hf.multi_query else hf.num_attention_heads

    @classmethod
    def attention_scale(cls, hf: Any, head_dim: int, layer: int) -> float:
        return head_dim**-0.5 if hf.scale_attn_weights else 1.0

    @classmethod
    def checkpoint_layout(cls, config: ArchConfig) -> WeightSpec:
        if config.hf.multi_query:  # [q heads | the k head | the v head]
            parts = FusedRows((("q", config.num_heads), ("k", 1), ("v", 1)), unit=config.head_dim)
        else:  # [head][q | k | v]
            parts = FusedRows(
                (("q", 1), ("k", 1), ("v", 1)), num_groups=config.num_heads, unit=config.head_dim
            )
        return WeightSpec(
            fused={"c_attn": parts}, renames=(("transformer.", ""),), ignored=_IGNORED
        )
