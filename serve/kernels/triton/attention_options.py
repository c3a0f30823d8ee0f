"""ALiBi, sliding window and logit soft-cap, as the attention kernels take them.

The semantics are the reference's (`serve.kernels.reference.paged_attention`): for query
position i and key position j, `s = scale * q.k`, then `s = c * tanh(s / c)`, then
`s += slope[head] * (j - i)`, and keys with `i - j >= window` are masked.

The kernels keep scores in base 2 (`s * log2(e)`, for `exp2`), and both options are linear
maps of the natural score, so they carry over with their constants scaled:

| natural units               | base 2 (what a kernel computes)                           |
|-----------------------------|-----------------------------------------------------------|
| `c * tanh(s / c)`           | `c2 * tanh(s2 / c2)`, with `s2 = s log2e`, `c2 = c log2e`  |
| `s + slope * (j - i)`       | `s2 + (slope log2e) * (j - i)`                            |

Each option is a `tl.constexpr` flag in the kernels: off, it is compiled out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
KERNEL_LOG2E = tl.constexpr(LOG2E)  # the same, for kernels: they may read only constexpr globals


@dataclass(frozen=True)
class AttentionOptions:
    alibi_slopes: torch.Tensor | None  # [num_heads] float32, contiguous, on the query's device
    sliding_window: int | None  # >= 1: a query sees itself and the window - 1 keys before it
    logit_softcap: float | None  # > 0

    @classmethod
    def checked(
        cls,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        alibi_slopes: torch.Tensor | None,
        sliding_window: int | None,
        logit_softcap: float | None,
    ) -> AttentionOptions:
        """The options, or a ValueError that says which one is wrong and why."""
        num_heads = query.shape[1]
        if alibi_slopes is not None:
            if not isinstance(alibi_slopes, torch.Tensor):
                raise ValueError(
                    f"alibi_slopes must be a tensor, got {type(alibi_slopes).__name__}."
                )
            if alibi_slopes.shape != (num_heads,):
                raise ValueError(
                    f"alibi_slopes must have shape ({num_heads},), one slope per query head, "
                    f"got {tuple(alibi_slopes.shape)}."
                )
            if alibi_slopes.dtype != torch.float32:
                raise ValueError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}.")
            if alibi_slopes.device != query.device:
                raise ValueError(
                    f"alibi_slopes must be on the query's device {query.device}, "
                    f"got {alibi_slopes.device}."
                )
            if not alibi_slopes.is_contiguous():
                raise ValueError("alibi_slopes must be contiguous.")
        if sliding_window is not None:
            if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
                raise ValueError(f"sliding_window must be an int, got {sliding_window!r}.")
            if sliding_window < 1:
                raise ValueError(f"sliding_window must be >= 1, got {sliding_window}.")
        if logit_softcap is not None:
            if isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float)):
                raise ValueError(f"logit_softcap must be a number, got {logit_softcap!r}.")
            if not (logit_softcap > 0 and math.isfinite(logit_softcap)):
                raise ValueError(f"logit_softcap must be a finite number > 0, got {logit_softcap}.")
        return cls(alibi_slopes, sliding_window, logit_softcap)

    def kernel_args(self, placeholder: torch.Tensor) -> tuple[torch.Tensor, int, float]:
        """The kernels' runtime arguments `(alibi_slopes_ptr, sliding_window, softcap_log2)`;
        an option that is off passes a placeholder its kernel never reads."""
        return (
            placeholder if self.alibi_slopes is None else self.alibi_slopes,
            self.sliding_window or 0,
            0.0 if self.logit_softcap is None else self.logit_softcap * LOG2E,
        )

    def kernel_flags(self) -> dict[str, bool]:
        """The kernels' constexpr flags: an option that is off is compiled out."""
        return {
            "HAS_ALIBI": self.alibi_slopes is not None,
            "HAS_WINDOW": self.sliding_window is not None,
            "HAS_SOFTCAP": self.logit_softcap is not None,
        }


@triton.jit
def soft_cap(scores, cap):
    """`cap * tanh(scores / cap)`. tanh from one exp2 of a non-positive argument: it cannot
    overflow, and saturates to exactly +-1 for large |x|."""
    x = scores / cap
    e = tl.exp2(tl.abs(x) * (-2.0 * KERNEL_LOG2E))  # exp(-2|x|), in (0, 1]
    t = (1.0 - e) / (1.0 + e)  # tanh(|x|)
    return cap * tl.where(x < 0, -t, t)
