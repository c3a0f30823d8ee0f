"""Qwen (v1, `QWenLMHeadModel`), whose transformers code is its own (`model_type` qwen): the
block is Qwen2's (RMSNorm, q/k/v biases, no o bias, SwiGLU), in its own names and config
spellings. The config is read as data (loader.load_hf_config).

| Qwen v1                        | here (Llama's names)                                  |
|--------------------------------|-------------------------------------------------------|
| `transformer.wte`, `.h.N`, `.ln_f` | `model.embed_tokens`, `model.layers.N`, `model.norm` |
| `ln_1`, `ln_2`                 | `input_layernorm`, `post_attention_layernorm`         |
| `attn.c_attn` [q; k; v] + bias | `self_attn.qkv_proj`                                  |
| `attn.c_proj` (no bias)        | `self_attn.o_proj`                                    |
| `mlp.w1`, `mlp.w2`, `mlp.c_proj` | up, gate, `mlp.down_proj`: c_proj(w1(x) * silu(w2(x))) |
| `kv_channels`                  | `head_dim`                                            |
| `intermediate_size` (2 widths) | `intermediate_size` // 2, the width of w1 and w2      |
| `layer_norm_epsilon`, `rotary_emb_base` | `rms_norm_eps`, `rope_theta`                 |
| `rotary_pct`                   | rotates the first `rotary_pct` of each head           |
| `no_bias` (always true)        | no bias on c_proj, w1, w2                             |

Context: `seq_length`, served exactly. Qwen's code changes nothing within it, and beyond it
changes two things: `use_dynamic_ntk` raises the rotary base with the length of the whole
context at each forward (keys cached earlier keep their old rotation), and `use_logn_attn`
scales queries past `seq_length` by log_seq_length(position). Neither is a per-position
rule a paged cache can reproduce, so longer contexts are refused (--max-model-len at most
`seq_length`) rather than served differently.
"""

from __future__ import annotations

from typing import Any

from serve.models.arch_config import ArchConfig, hf_with
from serve.models.llama import Qwen2ForCausalLM
from serve.models.weights import FusedRows, WeightSpec

QWEN_RENAMES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.h.", "model.layers."),
    ("transformer.ln_f.", "model.norm."),
    (".ln_1.", ".input_layernorm."),
    (".ln_2.", ".post_attention_layernorm."),
    (".attn.c_attn.", ".self_attn.qkv_proj."),
    (".attn.c_proj.", ".self_attn.o_proj."),
    (".mlp.c_proj.", ".mlp.down_proj."),
)
# c_proj(w1(x) * silu(w2(x))): w2 is the gate, w1 the up projection.
QWEN_PACKED = {"w1": ("gate_up_proj", "up"), "w2": ("gate_up_proj", "gate")}


class QWenLMHeadModel(Qwen2ForCausalLM):
    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        num_heads, hidden_size = int(hf.num_attention_heads), int(hf.hidden_size)
        head_dim = int(getattr(hf, "kv_channels", None) or hidden_size // num_heads)
        if head_dim * num_heads != hidden_size:
            # Qwen's code splits c_attn's output at hidden_size: it runs only when they match.
            raise ValueError(
                f"Qwen: kv_channels {head_dim} x num_attention_heads {num_heads} must equal "
                f"hidden_size {hidden_size}."
            )
        has_bias = not getattr(hf, "no_bias", True)
        rotary_emb_base = getattr(hf, "rotary_emb_base", 10000.0)
        hf = hf_with(
            hf,
            head_dim=head_dim,
            num_key_value_heads=num_heads,
            intermediate_size=int(hf.intermediate_size) // 2,
            rms_norm_eps=getattr(hf, "layer_norm_epsilon", 1e-6),
            rope_parameters={"rope_type": "default", "rope_theta": float(rotary_emb_base)},
            rotary_pct=float(getattr(hf, "rotary_pct", 1.0)),
            attention_bias=has_bias,  # c_proj's (c_attn always has one)
            mlp_bias=has_bias,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        )
        seq_length = int(getattr(hf, "seq_length", None) or 2048)  # QWenConfig's default
        return ArchConfig.from_hf(hf, architecture, max_position=seq_length)

    def __init__(self, config: ArchConfig) -> None:
        super().__init__(config)
        rows = config.num_heads * config.head_dim
        self.weight_spec = WeightSpec(
            packed=QWEN_PACKED,
            fused={"qkv_proj": FusedRows((("q", rows), ("k", rows), ("v", rows)))},
            renames=QWEN_RENAMES,
        )
