"""OLMo 2 over a flat token stream of the whole batch.

Llama's projections and MLP with the norms moved: none before a block, one on each block's
output before the residual add (`post_attention_layernorm`, `post_feedforward_layernorm`),
and q and k RMS-normalised over their whole projections (all heads together), before the
rotation.

Tensor parallel as Llama, but each rank holds only its heads' part of the q and k
projections, so their norms all-reduce the sums of squares (ShardedRMSNorm): one small
collective each per layer, besides the two the blocks close with.
"""

from __future__ import annotations

import torch
from torch import nn

from serve.distributed.parallel_state import get_tp_group
from serve.models.arch_config import ArchConfig
from serve.models.layers.attention import Attention
from serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from serve.models.layers.layernorm import RMSNorm, ShardedRMSNorm
from serve.models.layers.linear import QKVParallelLinear, RowParallelLinear
from serve.models.layers.rotary import get_rope, rope_parameters
from serve.models.llama import LLAMA_PACKED, LlamaMLP
from serve.models.partition import first_kv_head
from serve.models.weights import WeightSpec


class Olmo2Attention(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.head_dim = head_dim = config.head_dim
        bias = bool(getattr(hf, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_heads, config.num_kv_heads, bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_heads * head_dim, config.hidden_size, bias)
        tp = get_tp_group()
        q_rows, kv_rows = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.q_norm = ShardedRMSNorm(
            config.num_heads * head_dim, tp.rank * q_rows, q_rows, hf.rms_norm_eps
        )
        kv_start = first_kv_head(config.num_kv_heads, tp.world_size, tp.rank) * head_dim
        kv_copies = max(1, tp.world_size // config.num_kv_heads)  # ranks holding each KV head
        self.k_norm = ShardedRMSNorm(
            config.num_kv_heads * head_dim, kv_start, kv_rows, hf.rms_norm_eps, kv_copies
        )
        self.rotary_emb = get_rope(head_dim, config.max_position, rope_parameters(hf))
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # this rank's heads
        q = self.q_norm(q).view(-1, self.num_heads, self.head_dim)  # [T, num_heads, head_dim]
        k = self.k_norm(k).view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))  # [T, hidden], reduced over ranks


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.self_attn = Olmo2Attention(config)
        self.mlp = LlamaMLP(config.hidden_size, hf.intermediate_size, hf.hidden_act, bias=False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, x))  # [T, hidden]
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.hf.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class Olmo2ForCausalLM(nn.Module):
    weight_spec = WeightSpec(packed=LLAMA_PACKED)

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        self.model = Olmo2Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config.hf, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] on rank 0, None on the other ranks (a collective)."""
        return self.lm_head(hidden)
