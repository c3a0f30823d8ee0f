"""The Llama family (Llama 2/3, Mistral, Qwen2) over a flat token stream of the whole batch.

Tensor parallel (Megatron style): each rank holds its share of the attention heads and of
the MLP's intermediate columns, and one all-reduce closes each attention block and each
MLP; norms and residuals are replicated. At one rank every layer is a plain one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from serve.models.layers.activation import SiluAndMul
from serve.models.layers.attention import Attention
from serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from serve.models.layers.layernorm import RMSNorm
from serve.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from serve.models.layers.rotary import RotaryEmbedding, rope_parameters
from serve.models.lazy_tensor import LazyTensor


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, total_heads, total_kv_heads, qkv_bias
        )
        # This rank's heads: attention and its KV cache hold only these.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        o_bias = bool(getattr(config, "attention_bias", False))
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=o_bias)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, rope_parameters(config)
        )
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # This rank's heads: [T, num_heads * head_dim], [T, num_kv_heads * head_dim] x 2
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))  # [T, hidden], reduced over ranks


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu).")
        inter, bias = config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], ["gate", "up"], bias
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> [T, 2 * inter / tp] -> [T, inter / tp] -> [T, hidden], reduced
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

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
    def __init__(self, config: Any, qkv_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (our fused parameter fragment, shard name)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    qkv_bias = False

    def __init__(self, config: Any) -> None:
        super().__init__()
        qkv_bias = self.qkv_bias or bool(getattr(config, "attention_bias", False))
        self.model = LlamaModel(config, qkv_bias)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] on rank 0, None on the other ranks. A collective:
        every rank calls it, with the same N."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, LazyTensor | torch.Tensor]]) -> None:
        """Hand each checkpoint tensor to its parameter's `weight_loader`, which reads this
        rank's part of it (a fused parameter's loader is told which shard it is)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # the checkpoint may carry the tied copy; ours is the embedding
            target, shard = name, None
            for fragment, (fused, fused_shard) in self.packed_modules_mapping.items():
                if f".{fragment}." in name:
                    target, shard = name.replace(fragment, fused), fused_shard
                    break
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            param = params[target]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                weight_loader(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r} -> {target}: {e}") from None
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(
                f"checkpoint lacks weights for: {', '.join(missing[:8])}"
                + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            )


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True  # Qwen2 always has q/k/v biases, no o_proj bias
