"""Rotary position embeddings with the HF `rope_parameters` / `rope_scaling` variants."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from serve import kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings whichever way the config spells them (`rope_parameters` in newer
    transformers, `rope_theta` + `rope_scaling` in older ones)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _inv_freq(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params.get("rope_theta", 10000.0))
    # float32 throughout, as HF computes it, so positions rotate bit-for-bit alike.
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(
        f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})."
    )


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict[str, Any],
        rotary_dim: int | None = None,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        rotary_dim = rotary_dim or head_dim
        inv_freq = _inv_freq(rotary_dim, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, rotary_dim]
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.is_neox_style = is_neox_style

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox_style)
