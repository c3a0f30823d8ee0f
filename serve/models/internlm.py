"""InternLM (v1): Llama with biases on q, k, v and o, in a checkpoint whose transformers code
is its own (`model_type` internlm). The config is read as data (loader.load_hf_config) and
its spellings are mapped onto Llama's here; the tensor names are Llama's.

| InternLM config              | Llama's name       |
|------------------------------|--------------------|
| `bias` (default true)        | `attention_bias`   |
| `rotary.base` (default 1e4)  | `rope_theta`       |

`rotary.type` "dynamic" (NTK scaling) changes the rotation only for contexts longer than
`max_position_embeddings`, the longest context served, so "origin" and "dynamic" rotate
alike here.
"""

from __future__ import annotations

from typing import Any

from serve.models.arch_config import ArchConfig, hf_with
from serve.models.llama import LlamaForCausalLM


class InternLMForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        rotary = dict(getattr(hf, "rotary", None) or {})
        if rotary.get("type", "origin") not in ("origin", "dynamic"):
            raise ValueError(f"InternLM rotary type {rotary['type']!r}: origin or dynamic only.")
        base = rotary.get("base", getattr(hf, "rope_theta", None) or 10000.0)
        hf = hf_with(
            hf,
            attention_bias=bool(getattr(hf, "bias", True)),
            rope_parameters={"rope_type": "default", "rope_theta": float(base)},
            rms_norm_eps=getattr(hf, "rms_norm_eps", 1e-6),
        )
        return ArchConfig.from_hf(hf, architecture)
