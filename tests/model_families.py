"""Every model family serve runs natively (and a few it runs through the transformers
backend), as a tiny random-weight transformers config.

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


# Tiny-shape fields GPT-2-era configs do not take: they have no GQA and no head_dim, and
# most name the MLP width their own way (n_inner, ffn_dim; GPT-NeoX keeps intermediate_size).
_MHA_ONLY = ("num_key_value_heads", "head_dim")
_MHA_OWN_WIDTH = (*_MHA_ONLY, "intermediate_size")

# Attention sinks (a learned logit per head in each softmax), sliding and full layers
# alternating, top-2 of 4 experts with biases and a clamped SwiGLU, YaRN rotary.
# Attention sinks (a learned logit per head in each softmax), sliding and full layers
# alternating, top-2 of 4 experts with biases and a clamped SwiGLU, YaRN rotary. Native
# (gpt_oss.py) and through the transformers backend.
GPT_OSS = Family(
    "gpt-oss",
    "gpt_oss",
    "GptOssForCausalLM",
    {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "swiglu_limit": 1.0,  # under the tiny model's activations: the clamps bite
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,  # x 4: the tiny shape's 512
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    },
    window=8,
)

FAMILIES: list[Family] = [
    Family(
        "llama", "llama", "LlamaForCausalLM", {"rope_theta": 10000.0, "tie_word_embeddings": True}
    ),
    Family(
        "mistral",
        "mistral",
        "MistralForCausalLM",
        {"rope_theta": 1000000.0, "tie_word_embeddings": False, "sliding_window": 12},
        window=12,
    ),
    Family(
        "qwen2",
        "qwen2",
        "Qwen2ForCausalLM",
        {"rope_theta": 1000000.0, "tie_word_embeddings": False},
    ),
    Family(
        "qwen3",
        "qwen3",
        "Qwen3ForCausalLM",
        {"rope_theta": 1000000.0, "tie_word_embeddings": True, "head_dim": 24},
    ),
    # Mixture of experts (serve/models/moe.py): top-2 of 4 experts, a window under the contexts.
    Family(
        "mixtral",
        "mixtral",
        "MixtralForCausalLM",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 96,
            "sliding_window": 12,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
        },
        window=12,
    ),
    # A shared expert, unnormalised top-k weights, layer 0 dense (decoder_sparse_step 2).
    Family(
        "qwen2-moe",
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
            "decoder_sparse_step": 2,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
        },
    ),
    # Normalised top-3 of 8, per-head q/k norm, layer 1 dense (mlp_only_layers).
    Family(
        "qwen3-moe",
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "head_dim": 24,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
        },
    ),
    # Multi-head latent attention (deepseek.py). V2-Lite's shape: no q LoRA, softmax routing
    # within the 2 of 4 groups holding the best experts, two shared experts, layer 0 dense.
    Family(
        "deepseek-v2",
        "deepseek_v2",
        "DeepseekV2ForCausalLM",
        {
            "q_lora_rank": None,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 24,
            "n_routed_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "n_shared_experts": 2,
            "first_k_dense_replace": 1,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
            "tie_word_embeddings": False,
        },
        drop=_MHA_ONLY,
    ),
    # V3's: q LoRA, sigmoid routing with the correction bias, groups by their best two,
    # renormalised and scaled; YaRN with V3's mscale pair (the attention scale grows with it).
    Family(
        "deepseek-v3",
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        {
            "q_lora_rank": 48,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 24,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "tie_word_embeddings": False,
        },
        drop=_MHA_ONLY,
    ),
    GPT_OSS,
    # The GPT-2 era (gpt2.py, gptj.py, gpt_neox.py, opt.py).
    Family("gpt2", "gpt2", "GPT2LMHeadModel", {"n_inner": 128}, drop=_MHA_OWN_WIDTH),
    Family(
        "gpt2-layer-scaled",  # Stanford CRFM's GPT-2s: scores scaled by 1 / (layer + 1)
        "gpt2",
        "GPT2LMHeadModel",
        {"n_inner": 128, "scale_attn_by_inverse_layer_idx": True, "initializer_range": 0.4},
        drop=_MHA_OWN_WIDTH,
    ),
    Family(
        "gpt-bigcode",  # multi-query: one KV head, replicated at two ranks
        "gpt_bigcode",
        "GPTBigCodeForCausalLM",
        {"n_inner": 64, "multi_query": True},
        drop=_MHA_OWN_WIDTH,
    ),
    Family(
        "gpt-bigcode-mha",
        "gpt_bigcode",
        "GPTBigCodeForCausalLM",
        {"n_inner": 64, "multi_query": False, "tie_word_embeddings": False},
        drop=_MHA_OWN_WIDTH,
    ),
    Family(  # partial interleaved rotary, untied head with a bias
        "gptj",
        "gptj",
        "GPTJForCausalLM",
        {"n_inner": 48, "rotary_dim": 8, "initializer_range": 0.5},
        drop=_MHA_OWN_WIDTH,
    ),
    Family(  # rotary on a quarter of each head, attention and MLP side by side
        "gpt-neox",
        "gpt_neox",
        "GPTNeoXForCausalLM",
        {"intermediate_size": 64, "rotary_pct": 0.25},
        drop=_MHA_ONLY,
    ),
    Family(
        "gpt-neox-sequential",
        "gpt_neox",
        "GPTNeoXForCausalLM",
        {
            "intermediate_size": 96,
            "rotary_pct": 0.5,
            "use_parallel_residual": False,
            "tie_word_embeddings": True,
        },
        drop=_MHA_ONLY,
    ),
    Family("opt", "opt", "OPTForCausalLM", {"ffn_dim": 128}, drop=_MHA_OWN_WIDTH),
    Family(  # OPT-350m: post-LN, narrow embeddings projected in and out
        "opt-350m",
        "opt",
        "OPTForCausalLM",
        {"ffn_dim": 32, "do_layer_norm_before": False, "word_embed_proj_dim": 48},
        drop=_MHA_OWN_WIDTH,
    ),
    Family(  # no final norm, no biases, norms without weights
        "opt-bare",
        "opt",
        "OPTForCausalLM",
        {
            "ffn_dim": 128,
            "_remove_final_layer_norm": True,
            "enable_bias": False,
            "layer_norm_elementwise_affine": False,
        },
        drop=_MHA_OWN_WIDTH,
    ),
    # Gemma, Phi-3, StableLM, Granite, OLMo 2 (gemma.py, llama.py, stablelm.py, olmo2.py).
    # Gemma 2: sandwich norms, (1 + w) RMSNorm, sqrt(hidden) embeddings, GeGLU; a local layer
    # (window 8) then a global one; both soft-caps far below the tiny model's scores and
    # logits; the attention scale from query_pre_attn_scalar, not head_dim.
    Family(
        "gemma2",
        "gemma2",
        "Gemma2ForCausalLM",
        {
            "sliding_window": 8,
            "attn_logit_softcapping": 10.0,  # the scores' median is ~9: the top half is capped
            "final_logit_softcapping": 5.0,  # the logits reach ~11
            "query_pre_attn_scalar": 8,
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        window=8,
    ),
    # Gemma 3: Gemma 2 plus per-head q/k norms, a rope per layer type (the local base, and a
    # linearly scaled global one); `sliding_window_pattern` is the older spelling of layer_types.
    # Untied: the tiny tied Gemma 3 only repeats its input token (gemma2 has the tied head).
    Family(
        "gemma3",
        "gemma3_text",
        "Gemma3ForCausalLM",
        {
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "final_logit_softcapping": 5.0,
            "tie_word_embeddings": False,
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
            },
        },
        window=8,
    ),
    # Phi-3: fused qkv / gate_up checkpoint tensors, LongRoPE's short factors (not 1) and its
    # attention factor (max / original = 8), a sliding window. Contexts here stay within
    # the original 64 positions; test_longrope.py covers the long factors.
    Family(
        "phi3",
        "phi3",
        "Phi3ForCausalLM",
        {
            "max_position_embeddings": 512,
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0, 4.5, 6.0, 9.0],
                "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 32.0],
            },
            "sliding_window": 12,
            "tie_word_embeddings": False,
        },
        window=12,
    ),
    # StableLM 2 1.6B's shape: LayerNorms, rotary on a quarter of each head, q/k/v biases.
    Family(
        "stablelm",
        "stablelm",
        "StableLmForCausalLM",
        {"partial_rotary_factor": 0.25, "use_qkv_bias": True, "tie_word_embeddings": False},
        drop=("head_dim",),
    ),
    # StableLM 2 12B's: a LayerNorm per q and k head, and the parallel residual.
    Family(
        "stablelm-parallel",
        "stablelm",
        "StableLmForCausalLM",
        {
            "partial_rotary_factor": 0.25,
            "qk_layernorm": True,
            "use_parallel_residual": True,
            "tie_word_embeddings": False,
        },
        drop=("head_dim",),
    ),
    # Granite: Llama with its four multipliers, none of them 1 (the attention scale is not
    # head_dim ** -0.5).
    Family(
        "granite",
        "granite",
        "GraniteForCausalLM",
        {
            "embedding_multiplier": 2.0,
            "attention_multiplier": 0.125,
            "residual_multiplier": 0.5,
            "logits_scaling": 4.0,
            "tie_word_embeddings": True,
        },
    ),
    # OLMo 2: norms after the blocks, q/k RMSNorm over whole projections (all-reduced at TP=2).
    Family(
        "olmo2",
        "olmo2",
        "Olmo2ForCausalLM",
        {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 500000.0},
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


# Families serve has no class for, run through the transformers backend (--model-impl auto
# picks it), at one rank: tests/models/test_transformers_backend.py runs them against HF.
BACKEND_FAMILIES: list[Family] = [
    # Sliding windows on 3 of 4 layers, a logit scale after the LM head, parallel blocks.
    Family(
        "cohere2",
        "cohere2",
        "Cohere2ForCausalLM",
        {"sliding_window": 8, "num_hidden_layers": 4, "logit_scale": 0.5},
        tp2=False,
        window=8,
    ),
    # Partial, interleaved rotary.
    Family("glm", "glm", "GlmForCausalLM", {"partial_rotary_factor": 0.5}, tp2=False),
    # NoPE on every fourth layer.
    Family("smollm3", "smollm3", "SmolLM3ForCausalLM", {"num_hidden_layers": 4}, tp2=False),
    GPT_OSS,  # sinks through the backend's attention function too
]

FAMILIES_BY_KEY = {f.key: f for f in FAMILIES + BACKEND_FAMILIES}
