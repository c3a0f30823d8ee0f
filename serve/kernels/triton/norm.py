"""RMSNorm, optionally fused with the residual add of a pre-norm transformer block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden], read when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden]
    residual_out_ptr,  # [num_tokens, hidden]: x + residual, written when HAS_RESIDUAL
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """float32 inside. The sum is rounded to x's dtype before it is normalised, so `out` is
    the norm of exactly the `residual_out` the next layer adds to; `out` rounds once."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        summed = (x + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / HIDDEN + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, x * inv_rms * weight, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """2-D with unit stride along the hidden dimension (a copy only for odd views)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
    *,
    out: torch.Tensor | None = None,  # [num_tokens, hidden]
    residual_out: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in float32; with `residual`, adds it first and also returns the sum.

    Inputs are not modified. The output has the dtype `weight * x` would have.
    """
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        shapes = f"{tuple(x.shape)} and {tuple(weight.shape)}"
        raise ValueError(f"rms_norm expects x [T, hidden] and weight [hidden], got {shapes}.")
    x = _rows(x)
    num_tokens, hidden = x.shape
    if out is None:
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=x.device)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}.")
        residual = _rows(residual)
        if residual_out is None:
            residual_out = torch.empty_like(x)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            x,
            x if residual is None else residual,
            weight,
            out,
            out if residual_out is None else residual_out,
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            out.stride(0),
            out.stride(0) if residual_out is None else residual_out.stride(0),
            eps,
            HIDDEN=hidden,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(max(block // 256, 1), 16),
        )
    return out if residual is None else (out, residual_out)
