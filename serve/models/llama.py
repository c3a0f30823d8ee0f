"""The Llama family (Llama 2/3, Mistral, Qwen2) over a flat token stream of the whole batch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from serve.models.layers.activation import SiluAndMul
from serve.models.layers.attention import Attention
from serve.models.layers.embedding import VocabEmbedding
from serve.models.layers.layernorm import RMSNorm
from serve.models.layers.linear import Linear, MergedLinear, default_weight_loader
from serve.models.layers.rotary import RotaryEmbedding, rope_parameters


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(hidden, [q_size, kv_size, kv_size], ["q", "k", "v"], qkv_bias)
        o_bias = bool(getattr(config, "attention_bias", False))
        self.o_proj = Linear(q_size, hidden, bias=o_bias)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, rope_parameters(config)
        )
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # [T, q_size], [T, kv_size] x 2
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu).")
        inter, bias = config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], ["gate", "up"], bias)
        self.down_proj = Linear(inter, config.hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
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
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # the checkpoint may carry the tied copy; ours is the embedding
            for fragment, (fused, shard) in self.packed_modules_mapping.items():
                if f".{fragment}." in name:
                    target = name.replace(fragment, fused)
                    param = params[target]
                    param.weight_loader(param, tensor, shard)
                    break
            else:
                target = name
                if target not in params:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                    )
                default_weight_loader(params[target], tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(
                f"checkpoint lacks weights for: {', '.join(missing[:8])}"
                + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            )


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True  # Qwen2 always has q/k/v biases, no o_proj bias
