"""Rotary position embeddings with the HF `rope_parameters` / `rope_scaling` variants."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from serve import kernels
from serve.models.forward_context import get_forward_context

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings whichever way the config spells them (`rope_parameters` in newer
    transformers, `rope_theta` + `rope_scaling` in older ones)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _frequencies(rotary_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor: what cos and sin are multiplied by, 1 but for YaRN)."""
    base = float(params.get("rope_theta", 10000.0))
    # float32 throughout, as HF computes it, so positions rotate bit-for-bit alike.
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(is_mid, mid, scaled), 1.0
    if rope_type == "yarn":
        return yarn_inv_freq(rotary_dim, params)
    raise ValueError(
        f"rope type {rope_type!r} is not supported natively (supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}); --model-impl transformers serves the model with "
        "transformers' own rotary code."
    )


def yarn_mscale(factor: float, weight: float = 1.0) -> float:
    """YaRN's magnitude scale for a context stretched `factor` times: 0.1 w ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0


def yarn_inv_freq(rotary_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: (inv_freq, attention factor).

    Dimensions that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), those turning more than `beta_fast` times are kept,
    and a linear ramp blends the ones between. cos and sin are scaled by the attention
    factor, 0.1 ln(factor) + 1 unless the config gives it (or DeepSeek's mscale pair).
    """
    base = float(params.get("rope_theta", 10000.0))
    original = int(params["original_max_position_embeddings"])
    factor = float(params["factor"])

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        weight, weight_all = params.get("mscale"), params.get("mscale_all_dim")
        if weight and weight_all:
            attention_factor = yarn_mscale(factor, weight) / yarn_mscale(factor, weight_all)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        # the dimension that turns `num_rotations` times over the original context
        return (
            rotary_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))
        )

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # [rotary_dim / 2]: 1 where the frequency is kept, 0 where interpolated
    # float32, in transformers' order of operations
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept
    return inv_freq, float(attention_factor)


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
        inv_freq, scale = _frequencies(rotary_dim, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cache = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)
        # cache: [max_position, rotary_dim]
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.is_neox_style = is_neox_style

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox_style)


# -- LongRoPE (Phi-3) -----------------------------------------------------------------------------


def longrope_inv_freqs(
    rotary_dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """LongRoPE's two frequency sets as transformers computes them: (short inv_freq, long
    inv_freq, attention factor, original_max_position_embeddings).

    Each set divides the base frequencies by its per-dimension factors (`short_factor`,
    `long_factor`); both cos and sin are multiplied by the attention factor, which defaults
    to sqrt(1 + ln(s) / ln(original)) for the context extension s = max / original.
    """
    base = float(params.get("rope_theta", 10000.0))
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    # float32, in transformers' order of operations: 1 / (factors * base ** (2i / d))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    short, long = (
        1.0 / (torch.tensor(params[key], dtype=torch.float32) * base**exponents)
        for key in ("short_factor", "long_factor")
    )
    return short, long, float(attention_factor), original


class LongRopeRotaryEmbedding(nn.Module):
    """Phi-3's LongRoPE: short factors while a sequence fits the original context, long
    factors once it is longer; cos and sin scaled by the attention factor.

    transformers picks one set per forward pass, long when the pass's last position is past
    `original_max_position_embeddings`. Here each sequence of the batch gets the set its
    own length (this step's `seq_lens`) calls for, so the set depends on step metadata: the
    one layer besides attention that reads the forward context. Position p rotates by row p
    of the cache's short half or row `max_position + p` of its long half.

    What stays exact per sequence: a sequence that never grows past the original context
    (short throughout), and one whose prompt is already past it when its first step
    computes it whole (long throughout). K/V cached before a sequence crosses the line keep
    their short rotation, where transformers' `generate` recomputes the whole sequence with
    the long set at the crossing (Phi3ForCausalLM.prepare_inputs_for_generation): from
    there on the two differ, as do a long prompt's chunks computed before its last one.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict[str, Any],
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        rotary_dim = rotary_dim or head_dim
        short, long, scale, self.original_max_position = longrope_inv_freqs(
            rotary_dim, params, max_position
        )
        self.max_position = max_position
        positions = torch.arange(max_position, dtype=torch.float32)
        halves = []
        for inv_freq in (short, long):
            freqs = torch.outer(positions, inv_freq)  # [max_position, rotary_dim / 2]
            halves.append(torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1))
        self.register_buffer("cos_sin_cache", torch.cat(halves), persistent=False)

    def cache_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """[T] positions -> [T] rows of `cos_sin_cache`: the long half's for the tokens of
        sequences past the original context at this step (the forward context's)."""
        meta = get_forward_context()
        is_long = meta.seq_lens > self.original_max_position  # [num_seqs]
        per_token = torch.repeat_interleave(
            is_long, meta.query_start_loc.diff(), output_size=positions.shape[0]
        )  # [T]
        return positions + per_token.to(positions.dtype) * self.max_position

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, heads, head_dim]; k: [T, kv_heads, head_dim]
        rows = self.cache_rows(positions)
        return kernels.rotary_embedding(rows, q, k, self.cos_sin_cache, True)


class MultimodalRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's M-RoPE: a token has three positions (frame, row, column; all equal for
    text), and each section of the frequencies (`mrope_section`, in order) turns by one of
    them. Given [3, T] positions, each token's cos/sin row is gathered from the one-position
    table by section, and the shared kernel rotates by those rows; given [T], it is plain
    rotary."""

    def __init__(
        self, head_dim: int, max_position: int, params: dict[str, Any], rotary_dim: int | None
    ) -> None:
        super().__init__(head_dim, max_position, params, rotary_dim)
        sections = [int(n) for n in params["mrope_section"]]
        half = self.cos_sin_cache.shape[-1] // 2
        if sum(sections) != half:
            raise ValueError(f"mrope_section {sections} must sum to {half}")
        which = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(sections)])
        self.register_buffer("section_of", which, persistent=False)  # [half]: 0, 1 or 2

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        half = self.section_of.shape[0]
        columns = torch.arange(half, device=positions.device)
        by_section = positions[self.section_of].t()  # [T, half]: each frequency's position
        cos = self.cos_sin_cache[:, :half][by_section, columns]
        sin = self.cos_sin_cache[:, half:][by_section, columns]
        rows = torch.cat((cos, sin), dim=-1)  # [T, rotary_dim]: one table row per token
        tokens = torch.arange(rows.shape[0], device=positions.device)
        return kernels.rotary_embedding(tokens, q, k, rows, self.is_neox_style)


def get_rope(
    head_dim: int, max_position: int, params: dict[str, Any], rotary_dim: int | None = None
) -> RotaryEmbedding | LongRopeRotaryEmbedding:
    """The neox-style rotary embedding for `params` (rope_parameters' output)."""
    if params["rope_type"] == "longrope":
        return LongRopeRotaryEmbedding(head_dim, max_position, params, rotary_dim)
    if "mrope_section" in params:
        return MultimodalRotaryEmbedding(head_dim, max_position, params, rotary_dim)
    return RotaryEmbedding(head_dim, max_position, params, rotary_dim)
