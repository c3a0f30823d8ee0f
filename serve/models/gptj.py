"""GPT-J: attention and MLP side by side off one LayerNorm (x + attn(ln(x)) + mlp(ln(x))),
rotary positions on the first `rotary_dim` channels of each head in GPT-J's interleaved
style (pairs 2i, 2i + 1), q/k/v without bias, an untied LM head with a bias.

Tensor parallel: heads split, the MLP splits its inner columns, the head and its bias
split by vocabulary; the attention and MLP outputs are each reduced over ranks.

Checkpoints name the body `transformer.*`; the parameters sit at the top of the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from serve.models.arch_config import ArchConfig
from serve.models.gpt2 import inner_size
from serve.models.layers.activation import Activation
from serve.models.layers.attention import Attention
from serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from serve.models.layers.layernorm import LayerNorm
from serve.models.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from serve.models.layers.rotary import RotaryEmbedding
from serve.models.weights import WeightSpec

# GPT-J's sinusoids: base 10000, no scaling.
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


class GPTJAttention(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        num_heads = config.num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, num_heads, num_heads)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim,
            config.max_position,
            _ROPE,
            rotary_dim=config.hf.rotary_dim or self.head_dim,
            is_neox_style=False,
        )
        self.attn = Attention(self.num_heads, self.head_dim, self.num_heads, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # [T, num_heads * head_dim] x 3
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_heads, self.head_dim)
        v = v.view(-1, self.num_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.out_proj(self.attn(q, k, v))  # [T, hidden], reduced over ranks


class GPTJMLP(nn.Module):
    def __init__(self, hidden_size: int, inner: int, act: str) -> None:
        super().__init__()
        self.fc_in = ColumnParallelLinear(hidden_size, inner, bias=True)
        self.act = Activation(act)
        self.fc_out = RowParallelLinear(inner, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> [T, inner / tp] -> [T, hidden], reduced
        return self.fc_out(self.act(self.fc_in(x)))


class GPTJBlock(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.ln_1 = LayerNorm(config.hidden_size, hf.layer_norm_epsilon)
        self.attn = GPTJAttention(config)
        self.mlp = GPTJMLP(config.hidden_size, inner_size(hf), hf.activation_function)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        normed = self.ln_1(x)  # [T, hidden]
        return self.attn(positions, normed) + self.mlp(normed) + x


class GPTJForCausalLM(nn.Module):
    weight_spec = WeightSpec(
        packed={
            "q_proj": ("qkv_proj", "q"),
            "k_proj": ("qkv_proj", "k"),
            "v_proj": ("qkv_proj", "v"),
        },
        renames=(("transformer.", ""),),
        ignored=(r"(^|\.)attn\.(bias|masked_bias)$",),  # old checkpoints' causal-mask buffers
    )

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList(GPTJBlock(config) for _ in range(config.num_layers))
        self.ln_f = LayerNorm(config.hidden_size, hf.layer_norm_epsilon)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=True)
        if hf.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        num_heads = hf.num_attention_heads
        return ArchConfig.from_hf(
            hf,
            architecture,
            num_kv_heads=num_heads,
            head_dim=hf.hidden_size // num_heads,
            split_sizes={"n_inner": inner_size(hf)},
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids)  # [T, hidden]
        for block in self.h:
            x = block(positions, x)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] on rank 0, None on the other ranks. A collective."""
        return self.lm_head(hidden)
