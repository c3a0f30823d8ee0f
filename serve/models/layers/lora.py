"""LoRA slots on a linear layer: several adapters' low-rank updates, applied per token.

With adapters, a linear layer computes y = x W^T + (x A_i^T) B_i^T for each token, where
i is the adapter of the token's request (none: no update). Each LoRA-capable layer holds
`max_loras` slots of A and B, padded to `max_rank`; the worker's LoRA manager writes an
adapter's slices into a slot and, for each step, names which rows of the token stream
use which slot (`LoRABatch`, set around the forward like the attention metadata). The
adapter's scale (alpha / r) is folded into B when it is written.

A fused layer (q/k/v, gate/up) gives each shard rows of A and a block of B of its own: an
adapter may train q and v and leave k. Under tensor parallelism a column-parallel layer holds B's rows of its shards
(A whole), a row-parallel one A's columns of its input slice (B whole): the row-parallel
update is then a partial sum, reduced with the layer's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from serve import kernels


@dataclass(frozen=True)
class LoRABatch:
    """One step's adapters: (slot, rows of the token stream) per slot in use; rows None
    means every token (one adapter for the whole step, the common case)."""

    groups: list[tuple[int, torch.Tensor | None]]


_current: LoRABatch | None = None


@contextmanager
def lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    global _current
    _current = batch
    try:
        yield
    finally:
        _current = None


def current_lora_batch() -> LoRABatch | None:
    """The step's adapters, or None when no token of the step has one."""
    return _current


@dataclass(frozen=True)
class LoRAShard:
    """One output part of a layer that an adapter may update on its own (q of qkv_proj):
    its rows [offset, offset + rows) of this rank's output."""

    name: str | None
    offset: int
    rows: int


class LoRASlots:
    """A layer's adapter slots. Per slot: A as one [shards * max_rank, in] tensor and B as
    one [out, shards * max_rank] tensor, block-diagonal over the shards (shard s's rows of
    the output read only its columns), so an update is two products whatever the shards:
    x A^T, then that times B^T. Each is its own allocation, so the products run through
    `kernels.linear` like the layer's own (on CPU: the native few-row kernel, or oneDNN on
    a copy reordered when the slot is rewritten)."""

    def __init__(
        self,
        shards: list[LoRAShard],
        in_features: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shards = shards
        self.max_rank = max_rank
        width = len(shards) * max_rank
        out_features = sum(s.rows for s in shards)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.a = [zeros(width, in_features) for _ in range(max_loras)]
        self.b = [zeros(out_features, width) for _ in range(max_loras)]
        self.used = [False] * max_loras  # whether the slot's adapter updates this layer

    def shard_index(self, name: str | None) -> int:
        for i, shard in enumerate(self.shards):
            if shard.name == name:
                return i
        raise KeyError(name)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.used[slot] = False

    def write(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Shard `shard` of the adapter in `slot`: a [rank, in], b [rows, rank] (scaled)."""
        rank, column = a.shape[0], shard * self.max_rank
        rows = self.shards[shard]
        self.a[slot][column : column + rank].copy_(a)
        self.b[slot][rows.offset : rows.offset + rows.rows, column : column + rank].copy_(b)
        self.used[slot] = True

    def add(self, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """`out` (x W^T of this rank) plus each token's adapter update, in place."""
        for slot, rows in batch.groups:
            if not self.used[slot]:
                continue  # the adapter leaves this layer alone
            xs = x if rows is None else x.index_select(0, rows)
            delta = kernels.linear(kernels.linear(xs, self.a[slot]), self.b[slot])
            if rows is None:
                out += delta
            else:
                out.index_add_(0, rows, delta)
        return out
