"""Triton kernels for CUDA, with the reference's function names and signatures.

Loaded only through `serve.kernels.backend` (never at `import serve`). Under
`TRITON_INTERPRET=1` the same kernels run on CPU tensors, which is how CI tests them.
`linear`, `argmax` and `top_p_cut` are torch's, as in the reference. `quantized_linear` is
a Triton GEMM that dequantizes the packed weight tile by tile in registers
(quantized_linear.py).
"""

from serve.kernels.reference import argmax, linear, top_p_cut
from serve.kernels.triton.activation import silu_and_mul
from serve.kernels.triton.cache_ops import copy_blocks, reshape_and_cache, swap_blocks
from serve.kernels.triton.moe import moe_experts
from serve.kernels.triton.norm import rms_norm
from serve.kernels.triton.paged_attention import paged_attention
from serve.kernels.triton.quantized_linear import quantized_linear
from serve.kernels.triton.rotary import rotary_embedding

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
