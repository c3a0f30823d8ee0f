"""SiLU-and-mul, the gated MLP's activation: silu(x[:, :d]) * x[:, d:]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_tokens, 2 * d]: gate, then up
    out_ptr,  # [num_tokens, d]
    stride_x,
    stride_out,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """float32 inside, rounded once on store (the reference rounds after each of its two ops)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, gate / (1.0 + tl.exp(-gate)) * up, mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * d]
    *,
    out: torch.Tensor | None = None,  # [num_tokens, d]
) -> torch.Tensor:  # [num_tokens, d]
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul expects [T, 2 * d], got {tuple(x.shape)}.")
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, d = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    if num_tokens:
        block = min(triton.next_power_of_2(d), 1024)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
            x, out, x.stride(0), out.stride(0), D=d, BLOCK=block, num_warps=4
        )
    return out
