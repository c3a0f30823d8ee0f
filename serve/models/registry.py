"""Model classes by HF `architectures` name, imported only when asked for.

A model class is built as `cls(config: ArchConfig)` and provides `forward(input_ids,
positions) -> hidden [T, hidden]`, `compute_logits(hidden) -> [N, vocab] | None` (None off
rank 0) and `weight_spec: WeightSpec` (how checkpoint names reach its parameters). It may
define `arch_config(hf, architecture) -> ArchConfig` (a classmethod) where its HF config
spells the shape in its own way.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from serve.models.arch_config import ArchConfig

# architecture -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "BloomForCausalLM": ("serve.models.bloom", "BloomForCausalLM"),
    "FalconForCausalLM": ("serve.models.falcon", "FalconForCausalLM"),
    "LlamaForCausalLM": ("serve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("serve.models.llama", "LlamaForCausalLM"),
    # MosaicML's checkpoints name their own class MPT..., transformers' is Mpt...
    "MPTForCausalLM": ("serve.models.mpt", "MptForCausalLM"),
    "MptForCausalLM": ("serve.models.mpt", "MptForCausalLM"),
    "Qwen2ForCausalLM": ("serve.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("serve.models.llama", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def _resolve(architectures: list[str] | None) -> tuple[str, type[nn.Module]]:
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            return arch, getattr(importlib.import_module(module_name), class_name)
    raise ValueError(
        f"Model architecture {architectures} is not supported. "
        f"Supported: {', '.join(supported_architectures())}."
    )


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    return _resolve(architectures)[1]


def get_arch_config(hf_config: Any) -> ArchConfig:
    """The model's normalised shape, as its family reads it from `hf_config`."""
    arch, model_class = _resolve(getattr(hf_config, "architectures", None))
    normalize = getattr(model_class, "arch_config", None)
    if normalize is not None:
        return normalize(hf_config, arch)
    return ArchConfig.from_hf(hf_config, arch)
