"""Model classes by HF `architectures` name, imported only when asked for."""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("serve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("serve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("serve.models.llama", "Qwen2ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(
        f"Model architecture {architectures} is not supported. "
        f"Supported: {', '.join(supported_architectures())}."
    )
