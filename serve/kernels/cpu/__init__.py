"""The ops on CPU tensors: the native C++ kernels where they pay, the torch reference
elsewhere (and everywhere when the native kernels cannot be built: `native.available()`).

Same names and signatures as `serve.kernels.reference`, whose docstrings hold the contracts.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from serve.kernels import reference
from serve.kernels.cache_dtypes import cache_fits
from serve.kernels.cpu import native
from serve.kernels.metadata import AttentionMetadata
from serve.kernels.packed_weight import PackedWeight, inputs_in_stored_order
from serve.kernels.reference import copy_blocks, moe_experts, swap_blocks

logger = logging.getLogger(__name__)

__all__ = [
    "argmax",
    "copy_blocks",
    "linear",
    "moe_experts",
    "paged_attention",
    "quantized_linear",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "swap_blocks",
    "top_p_cut",
]

# The dtypes the native kernels other than attention take (attention also takes float16).
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _native_rows(x: torch.Tensor) -> bool:
    """Whether the native row-wise kernels take `x`: [rows, n], contiguous, their dtype."""
    return x.dim() == 2 and x.is_contiguous() and x.dtype in _NATIVE_DTYPES and native.available()


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One pass per row, the residual add included, where torch takes seven ops."""
    if x.dim() == 2 and x.stride(1) == 1 and not x.is_contiguous():
        # rows apart in memory (a model's one KV head of k, cut from the QKV rows): copied
        # together, so they take the same pass as everywhere else (the native layer stack's)
        x = x.contiguous()
    fits = residual is None or (
        residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
    )
    if not (_native_rows(x) and fits and weight.dtype == x.dtype and weight.is_contiguous()):
        return reference.rms_norm(x, weight, eps, residual)
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else out  # x + residual
    torch.ops.serve_cpu.rms_norm(out, total, x, residual, weight, eps)
    return out if residual is None else (out, total)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2d] -> [T, d]
    if not (_native_rows(x) and x.shape[1] % 2 == 0):
        return reference.silu_and_mul(x)
    out = x.new_empty(x.shape[0], x.shape[1] // 2)
    torch.ops.serve_cpu.silu_and_mul(out, x)
    return out


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos half, then sin half
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass per token over q and k (strided views of the QKV output are read in place),
    where torch takes a gather of cos/sin, slices, four products, two sums and two concats."""
    fits = (
        query.dim() == key.dim() == 3
        and query.dtype == key.dtype
        and query.dtype in _NATIVE_DTYPES
        and query.stride(2) == 1
        and key.stride(2) == 1
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.is_contiguous()
        and native.available()
    )
    if not fits:
        return reference.rotary_embedding(positions, query, key, cos_sin_cache, is_neox_style)
    query_out = torch.empty(query.shape, dtype=query.dtype)
    key_out = torch.empty(key.shape, dtype=key.dtype)
    torch.ops.serve_cpu.rotary_embedding(
        query_out, key_out, positions, query, key, cos_sin_cache, is_neox_style
    )
    return query_out, key_out


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = skip this token
) -> None:
    """A row copy per (token, head) into its slot; the torch version masks, checks the mask
    (a sync on the result) and runs two index_copy_ calls."""
    fits = (
        key.dtype == value.dtype
        and key_cache.dtype == value_cache.dtype
        and cache_fits(key.dtype, key_cache.dtype)
        and key.dim() == 3
        and key.stride(2) == 1
        and value.stride(2) == 1
        and key_cache.stride(3) == 1
        and key_cache.stride() == value_cache.stride()
        and native.available()
    )
    if not fits:
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    torch.ops.serve_cpu.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    options = dict(
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        sinks=sinks,
    )
    if not native.available():
        return reference.paged_attention(query, key_cache, value_cache, meta, scale, **options)
    out = torch.empty_like(query)
    torch.ops.serve_cpu.paged_attention(
        out,
        query,
        key_cache,
        value_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        alibi_slopes,
        sliding_window or 0,
        logit_softcap or 0.0,
        sinks,
    )
    return out


# Linears of three rows and more run on a copy of the weight packed once, beside it (so a
# CPU model's weights take twice their memory; `SERVE_CPU_PREPACK=0` trades the speed back
# for it): in the native kernel's panels where they take the dtype (csrc/panel_linear.cpp:
# float32 anywhere, bfloat16 on CPUs with AVX512_BF16; 1.2-1.5x oneDNN at decode sizes,
# 1.02-1.04x at 512 rows; RESULTS.md, "Session 43"), else in oneDNN's blocked layout
# (1.6-1.9x MKL's sgemm at 8-64 rows; benchmarks/cpu_levers.py, lever `prepack`).
PREPACK_ENV_VAR = "SERVE_CPU_PREPACK"
_PACK_HINT_ROWS = 16  # the batch size oneDNN picks the layout for; any batch runs on it
_PACKABLE = (torch.float32, torch.bfloat16)


@functools.cache
def prepack_enabled() -> bool:
    if os.environ.get(PREPACK_ENV_VAR, "1") == "0":
        logger.info("Weight prepacking off (%s=0): MKL runs the linears.", PREPACK_ENV_VAR)
        return False
    return True


@functools.cache
def _onednn_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        logger.warning("This torch has no oneDNN: MKL runs the linears it would.")
        return False
    return True


@functools.cache
def panels_fit(dtype: torch.dtype) -> bool:
    """Whether the native panels take linears of `dtype` here (float32 wherever the native
    kernels are built; bfloat16 where the build targets AVX512_BF16)."""
    return native.available() and torch.ops.serve_cpu.panels_fit(dtype)


def weights_packed(dtype: torch.dtype) -> bool:
    """Whether linear weights of `dtype` get a packed copy beside them (twice the memory)."""
    if dtype not in _PACKABLE or not prepack_enabled():
        return False
    return panels_fit(dtype) or _onednn_available()


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` packed for `linear`: into the native kernel's panels where they take its
    dtype (a dense tensor, `panels_fit`), else into oneDNN's layout (an mkldnn tensor).
    Packed on first use and again whenever the weight is written in place (its version
    counter moves); None where it cannot be. Writes through `.data`,
    as the weight loaders make, are not seen: models load before their first forward."""
    entry = getattr(weight, "_serve_packed", None)
    if entry is not None and entry[1] == weight._version:
        return entry[0]
    if not weights_packed(weight.dtype) or not weight.is_contiguous():
        return None
    if panels_fit(weight.dtype):
        packed = torch.ops.serve_cpu.pack_panels(weight.detach())
    else:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS)
    weight._serve_packed = (packed, weight._version)
    return packed


# The most rows the few-row kernel takes; more run on the packed weights. With so few rows a
# product is a pass over the weights, which the few-row kernel streams in memory order.
# oneDNN's products of one and two rows are its slowest (the model's weights cycled from
# memory, float32: 24-29 ms for one or two rows against 19-23 for three; bfloat16: 13-19
# against 12-14); the few-row kernel's, 19-23 ms and 8-10 ms (RESULTS.md, "Session 18").
NATIVE_MAX_ROWS = 2
# The fewest rows that run on the packed weights: a forward of this many packs every weight
# it touches (the model runner's start-up forward). From here a row's output does not depend
# on the other rows (the panels' sums and oneDNN's alike).
PACKED_MIN_ROWS = NATIVE_MAX_ROWS + 1


def top_p_cut(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:  # -> [rows, 1]
    """Native for float32 rows: a selection per row (a few passes), where the reference
    sorts each row whose nucleus is wider than its candidates."""
    if not (_native_rows(logits) and logits.dtype == torch.float32 and logits.shape[1] > 0):
        return reference.top_p_cut(logits, top_p)
    out = logits.new_empty(logits.shape[0], 1)
    torch.ops.serve_cpu.top_p_cut(out, logits, top_p.float().contiguous())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:  # [rows, n] -> [rows] int64
    """Native for float32 rows: torch's CPU argmax is a scalar loop, ~18x its vectorised max
    (11 ms a step at 256 rows of a 49K vocabulary, one thread)."""
    fits = x.dim() == 2 and x.shape[1] and x.is_contiguous() and x.dtype == torch.float32
    if not (fits and native.available()):
        return reference.argmax(x)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    torch.ops.serve_cpu.argmax_rows(out, x)
    return out


def linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, out_features]
    """A row or two (one or two sequences decoding) go to the few-row kernel; more rows to
    the packed weight (`packed_weight`); F.linear where neither applies."""
    rows = x.shape[0] if x.dim() == 2 else -1
    if rows < 1 or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    native_fits = x.dtype in _NATIVE_DTYPES and weight.is_contiguous()
    if rows <= NATIVE_MAX_ROWS and native_fits and native.available():
        out = x.new_empty(rows, weight.shape[0])
        torch.ops.serve_cpu.linear_few_rows(out, x.contiguous(), weight, bias)
        return out
    packed = packed_weight(weight)
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    out = x.new_empty(rows, weight.shape[0])
    torch.ops.serve_cpu.linear_panels(out, x.contiguous(), packed, bias)
    return out


# Each kind's codes as the native kernel reads them (packed_weight.py's table).
_CODE_DTYPES = {
    "uint4": torch.uint8,
    "uint8": torch.uint8,
    "fp8": torch.float8_e4m3fn,
    "fp4": torch.uint8,
}


def quantized_linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: PackedWeight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, out_features]
    """The native kernel reads the codes in place: up to four rows streamed once (decode,
    where uint4 reads an eighth of float32's bytes), more rows against tiles of the weight
    dequantized once per call (csrc/quantized_linear.cpp). The reference, which
    dequantizes the whole weight every call, where the native kernel does not apply. Act
    order's inputs sorted by group (`input_perm`): x's columns gathered into that order
    here, so the kernel runs its grouped path."""
    fits = (
        x.dim() >= 2
        and x.shape[-1] == weight.in_features
        and x.dtype in _NATIVE_DTYPES
        and x.device.type == "cpu"
        and weight.codes.dtype == _CODE_DTYPES.get(weight.kind)
        and weight.codes.device.type == "cpu"
        and weight.scales.dtype == torch.float32
        and (weight.zeros is None or weight.zeros.dtype == torch.float32)
        and (weight.g_idx is None or weight.g_idx.dtype == torch.int64)
        and (weight.input_perm is None or weight.input_perm.dtype == torch.int64)
        and weight.group_size >= 1
        and (bias is None or (bias.dtype == x.dtype and bias.device.type == "cpu"))
        and native.available()
    )
    if not fits:
        return reference.quantized_linear(x, weight, bias)
    rows = inputs_in_stored_order(x.reshape(-1, weight.in_features), weight).contiguous()
    out = x.new_empty(rows.shape[0], weight.out_features)
    # contiguous() copies only what is not already: the packed parameters are.
    torch.ops.serve_cpu.quantized_linear(
        out,
        rows,
        weight.codes.contiguous(),
        weight.scales.contiguous(),
        None if weight.zeros is None else weight.zeros.contiguous(),
        None if weight.g_idx is None else weight.g_idx.contiguous(),
        weight.kind,
        weight.group_size,
        None if bias is None else bias.contiguous(),
    )
    return out.view(*x.shape[:-1], weight.out_features)
