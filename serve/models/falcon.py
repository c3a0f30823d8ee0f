"""Falcon over a flat token stream of the whole batch, in its three shapes:

| shape                  | config                             | K/V heads   | block                          |
|------------------------|------------------------------------|-------------|--------------------------------|
| 7B                     | `multi_query`, `parallel_attn`     | 1           | attention and MLP off one norm |
| 40B / 180B (11B)       | `new_decoder_architecture`         | num_kv_heads| parallel, ln_attn + ln_mlp (one norm with `num_ln_in_parallel_attn=1`) |
| RW (1B, 7B)            | `alibi`, `bias`, no `parallel_attn`| every head  | sequential, like GPT-2         |

The fused query_key_value's rows come grouped per K/V head: [group][its query heads, k,
v][head_dim] (7B: one group, RW: one group per head). Rotary positions except with ALiBi,
whose bias transformers adds before the 1/sqrt(head_dim) scale: the slopes here carry the
scale. LayerNorms with biases; the LM head is tied unless the config says otherwise.

Tensor parallel: each rank holds its query heads (and their slopes), its K/V heads or a
copy of the single one (7B), and its slice of the MLP; `dense` and `dense_4h_to_h`
all-reduce.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from serve.distributed.parallel_state import get_tp_group
from serve.models.arch_config import UNLIMITED_POSITIONS, ArchConfig
from serve.models.layers.activation import Activation
from serve.models.layers.attention import Attention, alibi_slopes
from serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from serve.models.layers.layernorm import LayerNorm
from serve.models.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from serve.models.layers.rotary import RotaryEmbedding, rope_parameters
from serve.models.weights import FusedRows, WeightSpec


def falcon_alibi_slopes(num_heads: int, head_dim: int) -> torch.Tensor:
    """[num_heads] float32: BLOOM's slopes rounded to bfloat16, as transformers' Falcon
    builds them, times the softmax scale (Falcon adds the bias before scaling).

    transformers also rounds each bias slope * key_position to bfloat16; the kernel
    computes slope * (key - query) in float32. The two agree exactly while the slopes are
    powers of two (up to 8 heads, and the first 8 of up to 15) and positions below 256.
    """
    slopes = alibi_slopes(num_heads).bfloat16().float()
    return slopes / math.sqrt(head_dim)


class FalconAttention(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.head_dim = config.head_dim
        self.query_key_value = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads, hf.bias
        )
        # This rank's heads: attention and its KV cache hold only these.
        self.num_heads = self.query_key_value.num_heads
        self.num_kv_heads = self.query_key_value.num_kv_heads
        self.dense = RowParallelLinear(config.hidden_size, config.hidden_size, hf.bias)
        slopes, self.rotary_emb = None, None
        if hf.alibi:
            first_head = get_tp_group().rank * self.num_heads
            slopes = falcon_alibi_slopes(config.num_heads, self.head_dim)
            slopes = slopes[first_head : first_head + self.num_heads]
        else:
            self.rotary_emb = RotaryEmbedding(
                self.head_dim, config.max_position, rope_parameters(hf)
            )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            1.0 / math.sqrt(self.head_dim),  # as torch's SDPA computes it
            alibi_slopes=slopes,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # This rank's heads: [T, num_heads * head_dim], [T, num_kv_heads * head_dim] x 2
        q, k, v = self.query_key_value.split(self.query_key_value(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.dense(self.attn(q, k, v))  # [T, hidden], reduced over ranks


class FalconMLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, act: str, bias: bool) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(hidden_size, ffn_hidden_size, bias)
        self.act = Activation(act)
        self.dense_4h_to_h = RowParallelLinear(ffn_hidden_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> [T, ffn / tp] -> [T, hidden], reduced
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        size, eps = config.hidden_size, hf.layer_norm_epsilon
        self.self_attention = FalconAttention(config)
        self.mlp = FalconMLP(size, hf.ffn_hidden_size, hf.activation, hf.bias)
        # The new decoder is always parallel (its `parallel_attn` is ignored).
        self.is_parallel = bool(hf.new_decoder_architecture or hf.parallel_attn)
        num_norms = (hf.num_ln_in_parallel_attn or 2) if hf.new_decoder_architecture else 1
        self.ln_attn = self.ln_mlp = self.input_layernorm = self.post_attention_layernorm = None
        if num_norms == 2:
            self.ln_attn, self.ln_mlp = LayerNorm(size, eps), LayerNorm(size, eps)
        else:
            self.input_layernorm = LayerNorm(size, eps)
        if not self.is_parallel:
            self.post_attention_layernorm = LayerNorm(size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden], the residual stream
        normed = (self.input_layernorm if self.ln_attn is None else self.ln_attn)(x)
        attn = self.self_attention(positions, normed)
        if not self.is_parallel:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        mlp_in = normed if self.ln_mlp is None else self.ln_mlp(x)
        return x + (self.mlp(mlp_in) + attn)


class FalconModel(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList(FalconDecoderLayer(config) for _ in range(config.num_layers))
        self.ln_f = LayerNorm(config.hidden_size, config.hf.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids)  # [T, hidden]
        for layer in self.h:
            x = layer(positions, x)
        return self.ln_f(x)


def falcon_qkv_layout(config: ArchConfig) -> FusedRows:
    """query_key_value's rows: per K/V head, its query heads, then its key and value."""
    queries_per_group = config.num_heads // config.num_kv_heads
    parts = (("q", queries_per_group), ("k", 1), ("v", 1))
    return FusedRows(parts, config.num_kv_heads, config.head_dim)


class FalconForCausalLM(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        self.transformer = FalconModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config.hf, "tie_word_embeddings", True):
            self.lm_head.weight = self.transformer.word_embeddings.weight
        self.weight_spec = WeightSpec(fused={"query_key_value": falcon_qkv_layout(config)})

    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        num_heads, hidden_size = int(hf.num_attention_heads), int(hf.hidden_size)
        if hf.new_decoder_architecture:
            num_kv_heads = int(hf.num_kv_heads)
        elif hf.multi_query:
            num_kv_heads = 1
        else:
            num_kv_heads = num_heads
        return ArchConfig.from_hf(
            hf,
            architecture,
            num_kv_heads=num_kv_heads,
            head_dim=hidden_size // num_heads,
            max_position=UNLIMITED_POSITIONS if hf.alibi else int(hf.max_position_embeddings),
            split_sizes={"ffn_hidden_size": int(hf.ffn_hidden_size)},
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer(input_ids, positions)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] on rank 0, None on the other ranks (a collective)."""
        return self.lm_head(hidden)
