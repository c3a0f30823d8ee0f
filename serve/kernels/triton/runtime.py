"""What the kernels need to know about where they run: a CUDA GPU, or Triton's CPU interpreter."""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from serve.kernels.backend import is_interpreting

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def can_launch(tensor: torch.Tensor) -> bool:
    """A Triton kernel can run on `tensor`: it is on CUDA, or the interpreter is on."""
    return tensor.is_cuda or is_interpreting()


def dot_operands(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """The dtype `tl.dot` operands are cast to, and the dot's input precision, for data in `dtype`.

    float32 uses "ieee": TF32 keeps 10 mantissa bits, ~1e-3 relative error. The interpreter
    does bfloat16 arithmetic on the raw bits (numpy has no bfloat16), so there every operand
    is float32; a kernel computes in float32 and rounds only where it stores.
    """
    if dtype not in TL_DTYPES:
        raise TypeError(f"Triton kernels support {list(TL_DTYPES)}, got {dtype}.")
    if dtype == torch.float32 or is_interpreting():
        return tl.float32, "ieee"
    return TL_DTYPES[dtype], "tf32"  # the precision applies to float32 operands only


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on `device`; 1 on the interpreter, which runs programs in turn."""
    if device.type != "cuda":
        return 1
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """The kernels index K and V with one set of strides: the cache engine allocates both alike."""
    if key_cache.dim() != 4:
        raise ValueError(
            f"KV cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(key_cache.shape)}."
        )
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError(
            "key and value caches must have the same shape and strides, got "
            f"{tuple(key_cache.shape)}/{key_cache.stride()} and "
            f"{tuple(value_cache.shape)}/{value_cache.stride()}."
        )
    if key_cache.dtype != value_cache.dtype or key_cache.device != value_cache.device:
        raise ValueError("key and value caches must share a dtype and a device.")
