"""Every model family serve runs natively, as a tiny random-weight transformers config.

Each entry is how a test builds one: the transformers `model_type`, the `architectures`
name the registry knows, and the family's own config fields on top of the shared tiny
shape (hidden 64, 2 layers, 4 heads; tiny_models.py). Tests parametrize over `FAMILIES`:
tests/models/test_families.py runs each one against HF transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    key: str  # test id, and the key `tiny_model_factory` builds it by
    model_type: str  # transformers' model_type (AutoConfig.for_model)
    architecture: str  # the `architectures` entry, as the registry knows it
    config: dict[str, Any] = field(default_factory=dict)  # on top of the tiny shape
    tp2: bool = True  # its heads and widths split over 2 ranks
    # A context this long crosses every layer's window; None: no window.
    window: int | None = None
    # Shape fields the family's config does not take (the tiny shape's defaults are dropped).
    drop: tuple[str, ...] = ()


FAMILIES: list[Family] = [
    Family("llama", "llama", "LlamaForCausalLM", {"rope_theta": 10000.0, "tie_word_embeddings": True}),
    Family(
        "mistral",
        "mistral",
        "MistralForCausalLM",
        {"rope_theta": 1000000.0, "tie_word_embeddings": False, "sliding_window": 12},
        window=12,
    ),
    Family("qwen2", "qwen2", "Qwen2ForCausalLM", {"rope_theta": 1000000.0, "tie_word_embeddings": False}),
    Family(
        "qwen3",
        "qwen3",
        "Qwen3ForCausalLM",
        {"rope_theta": 1000000.0, "tie_word_embeddings": True, "head_dim": 24},
    ),
]

# BLOOM, Falcon, MPT. ALiBi ones get non-power-of-two head counts where the family takes
# them (the slopes beyond the power of two), 3 heads per rank at TP=2 (each rank its own
# slopes). Their configs take none of the tiny shape's GQA, MLP-width or position fields.
_BLOOM_DROP = ("num_key_value_heads", "intermediate_size", "head_dim", "max_position_embeddings")
_FALCON_DROP = ("num_key_value_heads", "intermediate_size", "head_dim")
_MPT_DROP = _BLOOM_DROP
FAMILIES += [
    Family(
        "bloom",
        "bloom",
        "BloomForCausalLM",
        {"hidden_size": 96, "num_attention_heads": 6, "layer_norm_epsilon": 1e-5},
        drop=_BLOOM_DROP,
    ),
    Family(
        "bloom-post-ln-residual",
        "bloom",
        "BloomForCausalLM",
        # Normed residuals make the 0.2-std tiny model repeat one token; 0.1 does not.
        {
            "apply_residual_connection_post_layernorm": True,
            "tie_word_embeddings": False,
            "initializer_range": 0.1,
        },
        drop=_BLOOM_DROP,
    ),
    # Falcon 7B: multi-query (one K/V head, a copy on each rank), attention and MLP in
    # parallel off one norm. (Tied, the parallel blocks repeat one token.)
    Family(
        "falcon-7b",
        "falcon",
        "FalconForCausalLM",
        {
            "multi_query": True,
            "parallel_attn": True,
            "tie_word_embeddings": False,
            "ffn_hidden_size": 128,
        },
        drop=_FALCON_DROP,
    ),
    # Falcon 40B / 180B: K/V groups in the fused qkv, ln_attn and ln_mlp.
    Family(
        "falcon-40b",
        "falcon",
        "FalconForCausalLM",
        {
            "new_decoder_architecture": True,
            "num_kv_heads": 2,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "ffn_hidden_size": 128,
            "initializer_range": 0.1,  # at 0.2 the parallel blocks repeat one token
        },
        drop=_FALCON_DROP,
    ),
    # Falcon 11B: the new decoder with one norm for attention and MLP, a tied head.
    Family(
        "falcon-11b",
        "falcon",
        "FalconForCausalLM",
        {
            "new_decoder_architecture": True,
            "num_kv_heads": 2,
            "num_ln_in_parallel_attn": 1,
            "ffn_hidden_size": 128,
        },
        drop=_FALCON_DROP,
    ),
    # Falcon RW: ALiBi added before the scale, biases, sequential blocks, K/V per head.
    Family(
        "falcon-rw-alibi",
        "falcon",
        "FalconForCausalLM",
        {
            "alibi": True,
            "bias": True,
            "multi_query": False,
            "parallel_attn": False,
            "hidden_size": 96,
            "num_attention_heads": 6,
        },
        drop=_FALCON_DROP,
    ),
    # MPT: 4 heads (power of two), no biases, a tied head.
    Family("mpt", "mpt", "MptForCausalLM", {"no_bias": True}, drop=_MPT_DROP),
    # 6 heads: MPT's interleaved slopes for a non-power-of-two count; clip_qkv clamps.
    # (qk_ln, which transformers ignores, is checked by tests/models/test_mpt_qk_ln.py.)
    Family(
        "mpt-6-heads-clip-qkv",
        "mpt",
        "MPTForCausalLM",
        {"hidden_size": 96, "num_attention_heads": 6, "attn_config": {"clip_qkv": 2.0}},
        drop=_MPT_DROP,
    ),
]

FAMILIES_BY_KEY = {f.key: f for f in FAMILIES}
