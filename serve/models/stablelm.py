"""StableLM (StableLM 2, StableLM Zephyr, StableCode) over a flat token stream of the whole batch.

Llama's attention and MLP with LayerNorms (weight and bias) in place of RMSNorm, rotary on
the first `partial_rotary_factor` of each head, and config switches: q/k/v biases
(`use_qkv_bias`), a LayerNorm per head on q and k (`qk_layernorm`, one weight per head),
and GPT-J's parallel residual (`use_parallel_residual`: attention and MLP both read the
input norm's output, and both add to the residual).

Tensor parallel as Llama; each rank applies the q/k norms of the heads it holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from serve.distributed.parallel_state import get_tp_group
from serve.models.arch_config import ArchConfig
from serve.models.layers.attention import Attention
from serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from serve.models.layers.layernorm import LayerNorm, norm_adding
from serve.models.layers.linear import QKVParallelLinear, RowParallelLinear
from serve.models.layers.rotary import RotaryEmbedding, rope_parameters
from serve.models.llama import LLAMA_PACKED, LlamaMLP
from serve.models.native_layer_stack import LayerRunner
from serve.models.partition import first_kv_head
from serve.models.weights import WeightSpec


class PerHeadLayerNorm(nn.Module):
    """A LayerNorm (weight only) per head, as StableLM stores them (`norms.{head}.weight`).
    Every rank holds all the heads' weights (head_dim each) and applies its own heads'."""

    def __init__(
        self, head_dim: int, num_heads: int, first_head: int, num_local_heads: int, eps: float
    ) -> None:
        super().__init__()
        self.norms = nn.ModuleList(LayerNorm(head_dim, eps, bias=False) for _ in range(num_heads))
        self.first_head, self.num_local_heads = first_head, num_local_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, num_local_heads, head_dim]
        heads = range(self.first_head, self.first_head + self.num_local_heads)
        return torch.stack([self.norms[h](x[:, i]) for i, h in enumerate(heads)], dim=1)


class StableLmAttention(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_heads,
            config.num_kv_heads,
            bool(getattr(hf, "use_qkv_bias", False)),
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size)
        self.q_layernorm = self.k_layernorm = None
        if getattr(hf, "qk_layernorm", False):
            tp = get_tp_group()
            eps = hf.layer_norm_eps
            self.q_layernorm = PerHeadLayerNorm(
                self.head_dim, config.num_heads, tp.rank * self.num_heads, self.num_heads, eps
            )
            first_kv = first_kv_head(config.num_kv_heads, tp.world_size, tp.rank)
            self.k_layernorm = PerHeadLayerNorm(
                self.head_dim, config.num_kv_heads, first_kv, self.num_kv_heads, eps
            )
        rope = rope_parameters(hf)
        factor = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
        rotary_dim = int(self.head_dim * factor)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position, rope, rotary_dim)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, num_heads, head_dim], this rank's
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_layernorm is not None and self.k_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))  # [T, hidden], reduced over ranks


class StableLmDecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.self_attn = StableLmAttention(config)
        self.mlp = LlamaMLP(config.hidden_size, hf.intermediate_size, hf.hidden_act, bias=False)
        self.input_layernorm = LayerNorm(config.hidden_size, hf.layer_norm_eps)
        self.post_attention_layernorm = None
        if not getattr(hf, "use_parallel_residual", False):
            self.post_attention_layernorm = LayerNorm(config.hidden_size, hf.layer_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Parallel: (the layer's output, None). Sequential: (the MLP's output, the residual
        stream without it), as a Llama layer leaves them, each sum taken in the next norm."""
        if self.post_attention_layernorm is None:  # parallel residual
            h = self.input_layernorm(x)  # [T, hidden]
            return x + self.self_attn(positions, h) + self.mlp(h), None
        x, residual = norm_adding(self.input_layernorm, x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x), residual)
        return self.mlp(x), residual


class StableLmModel(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(StableLmDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = LayerNorm(config.hidden_size, config.hf.layer_norm_eps)
        self.run_layers = LayerRunner()  # on CPU, sequential layers in one native call

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        x, residual = self.run_layers(self.layers, positions, x)
        if residual is None:  # the parallel layers' output is whole
            return self.norm(x)
        x, _ = self.norm(x, residual)
        return x


class StableLmForCausalLM(nn.Module):
    weight_spec = WeightSpec(packed=LLAMA_PACKED)

    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        # transformers derives the head size from the hidden size, whatever `head_dim` says.
        return ArchConfig.from_hf(
            hf, architecture, head_dim=hf.hidden_size // hf.num_attention_heads
        )

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        self.model = StableLmModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config.hf, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] on rank 0, None on the other ranks (a collective)."""
        return self.lm_head(hidden)
