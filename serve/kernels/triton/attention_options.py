"""ALiBi, sliding window, logit soft-cap and attention sinks, as the attention kernels take them.

The semantics are the reference's (`serve.kernels.reference.paged_attention`): for query
position i and key position j, `s = scale * q.k`, then `s = c * tanh(s / c)`, then
`s += slope[head] * (j - i)`, and keys with `i - j >= window` are masked; a head's sink
is one more score in its softmax, with a zero value vector.

The kernels keep scores in base 2 (`s * log2(e)`, for `exp2`), and the options are linear
maps of the natural score (or scores themselves), so they carry over with their constants
scaled:

| natural units               | base 2 (what a kernel computes)                           |
|-----------------------------|-----------------------------------------------------------|
| `c * tanh(s / c)`           | `c2 * tanh(s2 / c2)`, with `s2 = s log2e`, `c2 = c log2e`  |
| `s + slope * (j - i)`       | `s2 + (slope log2e) * (j - i)`                            |
| sink logit `t`              | `t log2e`, folded into a row's max and sum after its keys |

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
    sinks: torch.Tensor | None  # [num_heads] float32, contiguous, on the query's device

    @classmethod
    def checked(
        cls,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        alibi_slopes: torch.Tensor | None,
        sliding_window: int | None,
        logit_softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> AttentionOptions:
        """The options, or a ValueError that says which one is wrong and why."""
        if alibi_slopes is not None:
            _check_per_head("alibi_slopes", "one slope per query head", alibi_slopes, query)
        if sinks is not None:
            _check_per_head("sinks", "one sink logit per query head", sinks, query)
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
        return cls(alibi_slopes, sliding_window, logit_softcap, sinks)

    def kernel_args(
        self, placeholder: torch.Tensor
    ) -> tuple[torch.Tensor, int, float, torch.Tensor]:
        """The kernels' runtime arguments `(alibi_slopes_ptr, sliding_window, softcap_log2,
        sinks_ptr)`; an option that is off passes a placeholder its kernel never reads."""
        return (
            placeholder if self.alibi_slopes is None else self.alibi_slopes,
            self.sliding_window or 0,
            0.0 if self.logit_softcap is None else self.logit_softcap * LOG2E,
            placeholder if self.sinks is None else self.sinks,
        )

    def kernel_flags(self) -> dict[str, bool]:
        """The kernels' constexpr flags: an option that is off is compiled out."""
        return {
            "HAS_ALIBI": self.alibi_slopes is not None,
            "HAS_WINDOW": self.sliding_window is not None,
            "HAS_SOFTCAP": self.logit_softcap is not None,
            "HAS_SINKS": self.sinks is not None,
        }


def _check_per_head(name: str, what: str, values: object, query: torch.Tensor) -> None:
    """A ValueError unless `values` is a [num_heads] float32 contiguous tensor on the
    query's device."""
    num_heads = query.shape[1]
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(values).__name__}.")
    if values.shape != (num_heads,):
        raise ValueError(
            f"{name} must have shape ({num_heads},), {what}, got {tuple(values.shape)}."
        )
    if values.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {values.dtype}.")
    if values.device != query.device:
        raise ValueError(
            f"{name} must be on the query's device {query.device}, got {values.device}."
        )
    if not values.is_contiguous():
        raise ValueError(f"{name} must be contiguous.")


@triton.jit
def soft_cap(scores, cap):
    """`cap * tanh(scores / cap)`. tanh from one exp2 of a non-positive argument: it cannot
    overflow, and saturates to exactly +-1 for large |x|."""
    x = scores / cap
    e = tl.exp2(tl.abs(x) * (-2.0 * KERNEL_LOG2E))  # exp(-2|x|), in (0, 1]
    t = (1.0 - e) / (1.0 + e)  # tanh(|x|)
    return cap * tl.where(x < 0, -t, t)
