"""The ops on CPU tensors: the native C++ kernels where they pay, the torch reference
elsewhere (and everywhere when the native kernels cannot be built: `native.available()`).

Same names and signatures as `serve.kernels.reference`, whose docstrings hold the contracts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from serve.kernels import reference
from serve.kernels.cpu import native
from serve.kernels.metadata import AttentionMetadata
from serve.kernels.reference import (
    copy_blocks,
    moe_experts,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    swap_blocks,
)

__all__ = [
    "copy_blocks",
    "linear",
    "moe_experts",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "swap_blocks",
]

# Sequences with up to this many new tokens (decodes, speculative checks, short chunks)
# attend in place in the native kernel; longer chunks gather their context once and run
# torch's fused attention, whose matmuls outrun the native kernel's per-key dot products
# once many queries share each key (benchmarks/kernels.py --cpu measures the crossover).
NATIVE_MAX_QUERY_LEN = 16


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
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    options = dict(
        alibi_slopes=alibi_slopes, sliding_window=sliding_window, logit_softcap=logit_softcap
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
        NATIVE_MAX_QUERY_LEN,
    )
    long_chunks = [b for b, n in enumerate(meta.query_lens_cpu) if n > NATIVE_MAX_QUERY_LEN]
    if long_chunks:
        reference.attend_chunks(
            out, query, key_cache, value_cache, meta, long_chunks, scale, **options
        )
    return out


# Below this many rows MKL's sgemm runs the product faster as W @ x^T than as x @ W^T
# (~1.4x on SmolLM2's decode-size projections, 2 cores). A single row (one sequence
# decoding) it runs at about half the memory bandwidth two rows reach; the native
# kernel streams the weights for it at ~2x MKL's speed (benchmarks/cpu_levers.py).
_SMALL_BATCH_ROWS = 128


def linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, out_features]
    rows = x.shape[0] if x.dim() == 2 else -1
    if not 0 < rows <= _SMALL_BATCH_ROWS:
        return F.linear(x, weight, bias)
    if (
        rows == 1
        and x.dtype == weight.dtype == torch.float32
        and weight.is_contiguous()
        and native.available()
    ):
        out = x.new_empty(1, weight.shape[0])
        torch.ops.serve_cpu.linear_few_rows(out, x.contiguous(), weight, bias)
        return out
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out.add_(bias)
