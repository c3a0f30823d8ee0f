"""Model classes by HF `architectures` name, imported only when asked for.

A model class is built as `cls(config: ArchConfig)` and provides `forward(input_ids,
positions) -> hidden [T, hidden]`, `compute_logits(hidden) -> [N, vocab] | None` (None off
rank 0) and `weight_spec: WeightSpec` (how checkpoint names reach its parameters). It may
define `arch_config(hf, architecture) -> ArchConfig` (a classmethod) where its HF config
spells the shape in its own way, and `load_weights(weights)` where its checkpoint is read
in parts (LLaVA: the language model by its spec, the vision tower whole). A model that
takes images adds `embed_images(images: list of tensor dicts) -> list of [tokens, hidden]`
and a `forward` keyword `image_embeddings` (rows, values) whose values replace those rows'
embeddings; one whose positions depend on its images (M-RoPE) adds
`multimodal_positions(positions, mm_rows) -> [3, T]`.

`model_impl` (--model-impl) chooses between serve's own classes ("native") and the
transformers backend ("transformers": transformers' modeling code with serve's paged
attention, transformers_backend.py); "auto" takes the native class where there is one.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from serve.models.arch_config import ArchConfig

# architecture -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    # Llama-shaped (llama.py): variants are flags and small subclasses.
    "LlamaForCausalLM": ("serve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("serve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("serve.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("serve.models.llama", "Qwen3ForCausalLM"),
    "GraniteForCausalLM": ("serve.models.llama", "GraniteForCausalLM"),
    "Phi3ForCausalLM": ("serve.models.llama", "Phi3ForCausalLM"),
    # Mixture of experts (moe.py) on the Llama block.
    "MixtralForCausalLM": ("serve.models.moe", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("serve.models.moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("serve.models.moe", "Qwen3MoeForCausalLM"),
    # Multi-head latent attention and DeepSeek's experts (deepseek.py).
    "DeepseekV2ForCausalLM": ("serve.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("serve.models.deepseek", "DeepseekV3ForCausalLM"),
    # Attention sinks and biased, clamped-SwiGLU experts (gpt_oss.py).
    "GptOssForCausalLM": ("serve.models.gpt_oss", "GptOssForCausalLM"),
    # Families of their own shape.
    "Gemma2ForCausalLM": ("serve.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("serve.models.gemma", "Gemma3ForCausalLM"),
    "StableLmForCausalLM": ("serve.models.stablelm", "StableLmForCausalLM"),
    "Olmo2ForCausalLM": ("serve.models.olmo2", "Olmo2ForCausalLM"),
    "GPT2LMHeadModel": ("serve.models.gpt2", "GPT2LMHeadModel"),
    "GPTBigCodeForCausalLM": ("serve.models.gpt2", "GPTBigCodeForCausalLM"),
    "GPTJForCausalLM": ("serve.models.gptj", "GPTJForCausalLM"),
    "GPTNeoXForCausalLM": ("serve.models.gpt_neox", "GPTNeoXForCausalLM"),
    "OPTForCausalLM": ("serve.models.opt", "OPTForCausalLM"),
    # ALiBi or rotary, fused per-head or grouped q/k/v.
    "BloomForCausalLM": ("serve.models.bloom", "BloomForCausalLM"),
    "FalconForCausalLM": ("serve.models.falcon", "FalconForCausalLM"),
    # MosaicML's checkpoints name their own class MPT..., transformers' is Mpt...
    "MPTForCausalLM": ("serve.models.mpt", "MptForCausalLM"),
    "MptForCausalLM": ("serve.models.mpt", "MptForCausalLM"),
    # Vision-language: an image encoder before a language model of the families above.
    "LlavaForConditionalGeneration": ("serve.models.llava", "LlavaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": (
        "serve.models.llava",
        "LlavaNextForConditionalGeneration",
    ),
    "Mistral3ForConditionalGeneration": (
        "serve.models.mistral3",
        "Mistral3ForConditionalGeneration",
    ),
    "Qwen2VLForConditionalGeneration": ("serve.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": (
        "serve.models.qwen2_vl",
        "Qwen2VLForConditionalGeneration",
    ),
    # Formats whose transformers code ships with the checkpoint: config.json is read as data.
    "AquilaForCausalLM": ("serve.models.llama", "LlamaForCausalLM"),
    "AquilaModel": ("serve.models.llama", "LlamaForCausalLM"),
    "InternLMForCausalLM": ("serve.models.internlm", "InternLMForCausalLM"),
    "BaiChuanForCausalLM": ("serve.models.baichuan", "BaiChuanForCausalLM"),
    "BaichuanForCausalLM": ("serve.models.baichuan", "BaichuanForCausalLM"),
    "QWenLMHeadModel": ("serve.models.qwen", "QWenLMHeadModel"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def _resolve(architectures: list[str] | None, model_impl: str) -> tuple[str, type[nn.Module]]:
    if model_impl != "transformers":
        for arch in architectures or []:
            if arch in _MODELS:
                module_name, class_name = _MODELS[arch]
                return arch, getattr(importlib.import_module(module_name), class_name)
    reasons = []
    if model_impl != "native":
        from serve.models import transformers_backend

        for arch in architectures or []:
            reason = transformers_backend.unsupported_reason(arch)
            if reason is None:
                return arch, transformers_backend.TransformersForCausalLM
            reasons.append(reason)
    raise ValueError(_unsupported_message(architectures, model_impl, reasons))


def _unsupported_message(
    architectures: list[str] | None, model_impl: str, reasons: list[str]
) -> str:
    how = {
        "native": " natively (--model-impl native)",
        "transformers": " by the transformers backend",
    }
    why = f" ({'; '.join(reasons)})" if reasons else ""
    return (
        f"Model architecture {architectures} is not supported{how.get(model_impl, '')}{why}. "
        f"Supported natively: {', '.join(supported_architectures())}; any other causal LM "
        "class shipped in transformers whose attention takes custom attention functions "
        "(`_supports_attention_backend`) runs through the transformers backend "
        "(--model-impl auto or transformers)."
    )


def get_model_class(architectures: list[str] | None, model_impl: str = "auto") -> type[nn.Module]:
    return _resolve(architectures, model_impl)[1]


def get_arch_config(hf_config: Any, model_impl: str = "auto") -> ArchConfig:
    """The model's normalised shape, as its family reads it from `hf_config`."""
    arch, model_class = _resolve(getattr(hf_config, "architectures", None), model_impl)
    normalize = getattr(model_class, "arch_config", None)
    if normalize is not None:
        return normalize(hf_config, arch)
    return ArchConfig.from_hf(hf_config, arch)
