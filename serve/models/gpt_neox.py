"""GPT-NeoX (Pythia, Dolly, StableLM-alpha): LayerNorm blocks with neox-style rotary on
the first `rotary_pct` of each head's channels, and a per-head fused QKV with bias.

`use_parallel_residual` (the default) runs attention and MLP side by side, each off its
own norm of the block's input: x + attn(ln1(x)) + mlp(ln2(x)); without it the block is
sequential: h = x + attn(ln1(x)), h + mlp(ln2(h)).

`query_key_value` holds, for each head, its q, k and v rows (head_dim each); it is cut
into our q, k and v shards per head. Tensor parallel: heads split, the MLP splits its
inner columns, attention and MLP are each reduced over ranks.

Checkpoints name the body `gpt_neox.*` and older ones the head `embed_out`; the
parameters sit at the top of the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from serve.models.arch_config import ArchConfig
from serve.models.layers.activation import Activation
from serve.models.layers.attention import Attention
from serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from serve.models.layers.layernorm import LayerNorm, norm_adding
from serve.models.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from serve.models.layers.rotary import RotaryEmbedding, rope_parameters
from serve.models.native_layer_stack import LayerRunner
from serve.models.weights import FusedRows, WeightSpec


class GPTNeoXAttention(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.head_dim, num_heads = config.head_dim, config.num_heads
        bias = hf.attention_bias
        self.query_key_value = QKVParallelLinear(
            config.hidden_size, self.head_dim, num_heads, num_heads, bias
        )
        self.num_heads = self.query_key_value.num_heads  # this rank's
        self.dense = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, bias)
        rope = rope_parameters(hf)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim,
            config.max_position,
            rope,
            rotary_dim=int(self.head_dim * rope.get("partial_rotary_factor", 1.0)),
        )
        self.attn = Attention(self.num_heads, self.head_dim, self.num_heads, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # [T, num_heads * head_dim] x 3, this rank's heads
        q, k, v = self.query_key_value.split(self.query_key_value(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_heads, self.head_dim)
        v = v.view(-1, self.num_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.dense(self.attn(q, k, v))  # [T, hidden], reduced over ranks


class GPTNeoXMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(hidden_size, intermediate_size, bias=True)
        self.act = Activation(act)
        self.dense_4h_to_h = RowParallelLinear(intermediate_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> [T, intermediate / tp] -> [T, hidden], reduced
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.use_parallel_residual = hf.use_parallel_residual
        self.input_layernorm = LayerNorm(config.hidden_size, hf.layer_norm_eps)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, hf.layer_norm_eps)
        self.attention = GPTNeoXAttention(config)
        self.mlp = GPTNeoXMLP(config.hidden_size, hf.intermediate_size, hf.hidden_act)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Parallel: (the layer's output, None). Sequential: (the MLP's output, the residual
        stream without it), as a Llama layer leaves them, each sum taken in the next norm."""
        if self.use_parallel_residual:  # [T, hidden]
            attn = self.attention(positions, self.input_layernorm(x))
            return self.mlp(self.post_attention_layernorm(x)) + attn + x, None
        x, residual = norm_adding(self.input_layernorm, x, residual)
        x, residual = self.post_attention_layernorm(self.attention(positions, x), residual)
        return self.mlp(x), residual


class GPTNeoXForCausalLM(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        qkv = FusedRows(
            (("q", 1), ("k", 1), ("v", 1)), num_groups=config.num_heads, unit=config.head_dim
        )
        self.weight_spec = WeightSpec(
            fused={"query_key_value": qkv},
            renames=(("gpt_neox.", ""), ("embed_out.", "lm_head.")),
            # Old checkpoints' causal-mask buffers and rotary frequencies.
            ignored=(r"\.attention\.(bias|masked_bias)$", r"rotary_emb\.inv_freq$"),
        )
        self.embed_in = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GPTNeoXLayer(config) for _ in range(config.num_layers))
        self.final_layer_norm = LayerNorm(config.hidden_size, hf.layer_norm_eps)
        self.run_layers = LayerRunner()  # on CPU, the layers in one native call
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if hf.tie_word_embeddings:
            self.lm_head.weight = self.embed_in.weight

    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        num_heads = hf.num_attention_heads
        return ArchConfig.from_hf(
            hf, architecture, num_kv_heads=num_heads, head_dim=hf.hidden_size // num_heads
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_in(input_ids)  # [T, hidden]
        x, residual = self.run_layers(self.layers, positions, x)
        if residual is None:  # the parallel layers' output is whole
            return self.final_layer_norm(x)
        x, _ = self.final_layer_norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] on rank 0, None on the other ranks. A collective."""
        return self.lm_head(hidden)
