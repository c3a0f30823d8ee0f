"""A checkpoint tensor not yet read: its shape now, its bytes when a weight loader asks.

Tensor-parallel ranks each read only their slice of a sharded weight: `narrow` reads just
that range from a safetensors file (memory-mapped, so the rest is never touched), and
`load` reads the whole tensor, for replicated weights. Pickled checkpoints are unpickled
whole anyway; their tensors are wrapped as they are.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class LazyTensor(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Elements [start, start + length) along `dim`, read now."""
        ...

    def load(self) -> torch.Tensor:
        """The whole tensor, read now."""
        ...


class SafetensorsTensor:
    """One tensor of an open safetensors file. Valid while the file is open: the loader
    yields it inside `safe_open`, and a weight loader reads it before asking for the next."""

    def __init__(self, handle: Any, name: str) -> None:  # handle: safetensors.safe_open
        self.handle, self.name = handle, name
        self.shape = tuple(handle.get_slice(name).get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim %= len(self.shape)
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self.handle.get_slice(self.name)[index]

    def load(self) -> torch.Tensor:
        return self.handle.get_tensor(self.name)


class InMemoryTensor:
    """A tensor already in memory (pickled checkpoints, tests), behind the same interface."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.shape = tuple(tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.tensor.narrow(dim, start, length)

    def load(self) -> torch.Tensor:
        return self.tensor


def as_lazy(x: LazyTensor | torch.Tensor) -> LazyTensor:
    return InMemoryTensor(x) if isinstance(x, torch.Tensor) else x
