"""The kernel interface the model layers call.

Today every op is the pure-torch reference (CPU, and correct on any device); the Triton
kernels for CUDA plug in behind these same names.
"""

from serve.kernels.metadata import AttentionMetadata
from serve.kernels.reference import (
    copy_blocks,
    linear,
    paged_attention,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    swap_blocks,
)

__all__ = [
    "AttentionMetadata",
    "copy_blocks",
    "linear",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "swap_blocks",
]
