"""OPT: learned absolute positions (position p reads row p + 2 of the table), ReLU MLP,
biases unless `enable_bias` is False, and a head tied to the token embedding.

Variants by config:
- `do_layer_norm_before` (the default) norms each sublayer's input; False (OPT-350m)
  norms each sublayer's output, after its residual sum, and has no final norm.
- `word_embed_proj_dim` < hidden (OPT-350m): token embeddings and the head are that
  narrow; `project_in` widens the embeddings, `project_out` narrows the last hidden state.
- `_remove_final_layer_norm`: no final norm; `layer_norm_elementwise_affine` False: norms
  without weight or bias.

Tensor parallel: heads split, the MLP splits its inner columns; the position table and
the two projections are replicated.

Checkpoints name the body `model.decoder.*`, or `decoder.*` (facebook/opt-*); the
parameters sit at the top of the model.
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
from serve.models.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from serve.models.native_layer_stack import LayerRunner
from serve.models.weights import WeightSpec

POSITION_OFFSET = 2  # OPT's table keeps two rows ahead of position 0 (fairseq's padding)


def _layer_norm(config: ArchConfig) -> LayerNorm:
    return LayerNorm(config.hidden_size, elementwise_affine=config.hf.layer_norm_elementwise_affine)


class OPTAttention(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        self.head_dim, num_heads = config.head_dim, config.num_heads
        bias = config.hf.enable_bias
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, num_heads, num_heads, bias
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, bias)
        # OPT scales q before the product, as transformers does (the same up to rounding).
        self.scale = self.head_dim**-0.5
        self.attn = Attention(self.num_heads, self.head_dim, self.num_heads, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # [T, num_heads * head_dim] x 3
        q = (q * self.scale).view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_heads, self.head_dim)
        v = v.view(-1, self.num_heads, self.head_dim)
        return self.out_proj(self.attn(q, k, v))  # [T, hidden], reduced over ranks


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.do_layer_norm_before = hf.do_layer_norm_before
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = _layer_norm(config)
        self.fc1 = ColumnParallelLinear(config.hidden_size, hf.ffn_dim, hf.enable_bias)
        self.activation_fn = Activation(hf.activation_function)
        self.fc2 = RowParallelLinear(hf.ffn_dim, config.hidden_size, hf.enable_bias)
        self.final_layer_norm = _layer_norm(config)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pre-norm: (the MLP's output, the residual stream without it), as a Llama layer
        leaves them, each sum taken in the next norm; post-norm: (the layer's output, None)."""
        del positions  # the model added them to the embeddings (LayerRunner passes them on)
        if not self.do_layer_norm_before:  # [T, hidden] -> [T, hidden]
            x = self.self_attn_layer_norm(x + self.self_attn(x))
            return self.final_layer_norm(x + self.fc2(self.activation_fn(self.fc1(x)))), None
        x, residual = norm_adding(self.self_attn_layer_norm, x, residual)
        x, residual = self.final_layer_norm(self.self_attn(x), residual)
        return self.fc2(self.activation_fn(self.fc1(x))), residual


class OPTForCausalLM(nn.Module):
    weight_spec = WeightSpec(
        packed={
            "q_proj": ("qkv_proj", "q"),
            "k_proj": ("qkv_proj", "k"),
            "v_proj": ("qkv_proj", "v"),
        },
        renames=(("model.decoder.", ""), ("decoder.", "")),
    )

    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        hidden, embed_dim = config.hidden_size, hf.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, embed_dim)
        self.embed_positions = ReplicatedEmbedding(config.max_position + POSITION_OFFSET, hidden)
        is_projected = embed_dim != hidden
        self.project_in = ReplicatedLinear(embed_dim, hidden) if is_projected else None
        self.project_out = ReplicatedLinear(hidden, embed_dim) if is_projected else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_layers))
        has_final_norm = hf.do_layer_norm_before and not hf._remove_final_layer_norm
        self.final_layer_norm = _layer_norm(config) if has_final_norm else None
        self.run_layers = LayerRunner()  # on CPU, pre-norm layers in one native call
        self.lm_head = ParallelLMHead(config.vocab_size, embed_dim)
        if hf.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        num_heads = hf.num_attention_heads
        return ArchConfig.from_hf(
            hf,
            architecture,
            num_kv_heads=num_heads,
            head_dim=hf.hidden_size // num_heads,
            split_sizes={"ffn_dim": hf.ffn_dim},
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, word_embed_proj_dim]
        if self.project_in is not None:
            x = self.project_in(x)  # [T, hidden]
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        x, residual = self.run_layers(self.layers, positions, x)
        if self.final_layer_norm is not None:
            x, _ = self.final_layer_norm(x, residual)
        elif residual is not None:  # pre-norm without a final norm: the last sum
            x = x + residual
        if self.project_out is not None:
            x = self.project_out(x)  # [T, word_embed_proj_dim]
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, word_embed_proj_dim] -> [N, vocab] on rank 0, None elsewhere. A collective."""
        return self.lm_head(hidden)
