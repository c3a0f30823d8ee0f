"""BLOOM over a flat token stream of the whole batch.

What sets it apart from Llama: ALiBi instead of rotary positions (no position limit), a
LayerNorm right after the embedding, one fused query_key_value with biases whose rows are
per head ([head][q | k | v][head_dim]), a plain GELU MLP of width 4 * hidden, LayerNorms
with biases, and optionally the residual taken after the norm
(`apply_residual_connection_post_layernorm`). The LM head is tied to the embedding unless
the config says otherwise.

Tensor parallel: each rank holds its heads (and their ALiBi slopes) and its share of the
MLP's columns; `dense` and `dense_4h_to_h` all-reduce.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from serve.distributed.parallel_state import get_tp_group
from serve.models.arch_config import UNLIMITED_POSITIONS, ArchConfig
from serve.models.layers.attention import Attention, alibi_slopes
from serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from serve.models.layers.layernorm import LayerNorm
from serve.models.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from serve.models.weights import FusedRows, WeightSpec


def bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    """BLOOM's tanh GELU, written exactly as transformers' `bloom_gelu_forward` (its
    constant and its order of operations differ from `gelu_fast` in the last bits)."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class BloomAttention(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.query_key_value = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_heads, config.num_heads, bias=True
        )
        self.num_heads = self.query_key_value.num_heads  # this rank's
        self.dense = RowParallelLinear(config.hidden_size, config.hidden_size, bias=True)
        first_head = get_tp_group().rank * self.num_heads
        slopes = alibi_slopes(config.num_heads)[first_head : first_head + self.num_heads]
        scale = 1.0 / math.sqrt(self.head_dim)  # as transformers computes it, to the last bit
        self.attn = Attention(
            self.num_heads, self.head_dim, self.num_heads, scale, alibi_slopes=slopes
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # This rank's heads: [T, num_heads * head_dim] x 3
        q, k, v = self.query_key_value.split(self.query_key_value(x))
        shape = (-1, self.num_heads, self.head_dim)
        return self.dense(self.attn(q.view(shape), k.view(shape), v.view(shape)))  # [T, hidden]


class BloomMLP(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(hidden_size, 4 * hidden_size, bias=True)
        self.dense_4h_to_h = RowParallelLinear(4 * hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> [T, 4 * hidden / tp] -> [T, hidden], reduced
        return self.dense_4h_to_h(bloom_gelu(self.dense_h_to_4h(x)))


class BloomBlock(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.input_layernorm = LayerNorm(config.hidden_size, hf.layer_norm_epsilon)
        self.self_attention = BloomAttention(config)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, hf.layer_norm_epsilon)
        self.mlp = BloomMLP(config.hidden_size)
        self.residual_after_norm = bool(hf.apply_residual_connection_post_layernorm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        normed = self.input_layernorm(x)
        x = self.self_attention(normed) + (normed if self.residual_after_norm else x)
        normed = self.post_attention_layernorm(x)
        return self.mlp(normed) + (normed if self.residual_after_norm else x)


class BloomForCausalLM(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        eps = config.hf.layer_norm_epsilon
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.word_embeddings_layernorm = LayerNorm(config.hidden_size, eps)
        self.h = nn.ModuleList(BloomBlock(config) for _ in range(config.num_layers))
        self.ln_f = LayerNorm(config.hidden_size, eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config.hf, "tie_word_embeddings", True):
            self.lm_head.weight = self.word_embeddings.weight
        # query_key_value's rows are [head][q | k | v][head_dim]: one group per head.
        # BigScience's checkpoints hold the bare model (`h.0...`, `word_embeddings...`),
        # those saved by transformers prefix it with `transformer.`: stripped, both load.
        fused = FusedRows((("q", 1), ("k", 1), ("v", 1)), config.num_heads, config.head_dim)
        self.weight_spec = WeightSpec(
            fused={"query_key_value": fused}, renames=(("transformer.", ""),)
        )

    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        # Every head has its own key and value; the MLP is 4 * hidden wide whatever the
        # config says; ALiBi does not limit the context.
        hidden_size, num_heads = int(hf.hidden_size), int(hf.n_head)
        return ArchConfig.from_hf(
            hf,
            architecture,
            num_kv_heads=num_heads,
            head_dim=hidden_size // num_heads,
            max_position=UNLIMITED_POSITIONS,
            split_sizes={"4 * hidden_size": 4 * hidden_size},
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Positions are unused: ALiBi biases the scores by the distance, in the kernel.
        x = self.word_embeddings_layernorm(self.word_embeddings(input_ids))  # [T, hidden]
        for block in self.h:
            x = block(x)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] on rank 0, None on the other ranks (a collective)."""
        return self.lm_head(hidden)
