"""What a KV cache may store beside the model's own dtype (--kv-cache-dtype), shared by the
torch reference, the native CPU kernels' wrappers and the Triton ops.

A cache may be narrower than the K/V written into it: a 16-bit float under float32 K/V, or
fp8 under any. Writes round to nearest; fp8 ones saturate at the format's largest finite
value first (e4m3fn has no infinity: torch turns anything past 448 into NaN), as vLLM's
unscaled fp8 cache writes do. Reads widen. fp8 blocks move as bytes: torch's CPU index ops
have no fp8 kernels.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SIXTEEN_BIT_DTYPES = (torch.bfloat16, torch.float16)
# --kv-cache-dtype's names (serve/config.py KV_CACHE_DTYPES, auto aside) and what they store.
KV_CACHE_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def cache_fits(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether a cache of `cache_dtype` takes K/V (and serves queries) of `dtype`."""
    if cache_dtype == dtype:
        return True
    if cache_dtype in FP8_DTYPES:
        return dtype in (torch.float32, *SIXTEEN_BIT_DTYPES)
    return dtype == torch.float32 and cache_dtype in SIXTEEN_BIT_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype; 0 for any other (no saturation)."""
    return float(torch.finfo(dtype).max) if dtype in FP8_DTYPES else 0.0


def narrowed(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype`, rounded to nearest; saturated first where `dtype` is fp8 (NaN stays)."""
    limit = fp8_max(dtype)
    if limit:
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A view of an fp8 tensor as uint8 (same strides), for the index ops torch lacks for
    fp8; any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t
