"""The tensor-parallel group this process belongs to.

A worker calls `init_tensor_parallel` once, before it builds the model; the parallel
layers read `get_tp_group()` when they are constructed (their rank's slice) and call its
collectives in `forward`. A process that never called it is one rank of one: the group's
collectives are the identity and torch.distributed is never touched, so single-rank code
(the engine's uniproc path, most tests) runs exactly as it would without this module.

Every collective must be entered by every rank, in the same order, with tensors of the
same shape: a rank that skips one leaves the others blocked until the group's timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")  # gloo: CPU tensors; nccl: CUDA tensors


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in the tensor-parallel group, and the group's collectives.

    Ranks are the default (world) process group's: tensor parallelism spans every process
    that `init_tensor_parallel` joined. The collectives take and return tensors on the
    backend's device; inputs need not be contiguous.
    """

    rank: int
    world_size: int

    @property
    def is_driver(self) -> bool:
        """Rank 0: it receives the gathered logits and samples."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, on every rank. Reduces in place when `x` is
        contiguous: pass a tensor this caller owns."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in rank order, on every rank."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
        """Every rank's `x` concatenated along `dim` in rank order on rank `dst`; None on
        the other ranks (they still must call it)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == dst else None
        dist.gather(x, parts, dst=dst)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `x` on every rank, written into `x` (same shape and dtype on every
        rank; contiguous, since it is received in place)."""
        if self.world_size == 1:
            return x
        if not x.is_contiguous():
            raise ValueError("broadcast receives in place: pass a contiguous tensor.")
        dist.broadcast(x, src=src)
        return x


_SINGLE_RANK = TensorParallelGroup(rank=0, world_size=1)

# Written only by init_tensor_parallel / destroy_tensor_parallel.
_group: TensorParallelGroup | None = None


def init_tensor_parallel(
    world_size: int,
    rank: int,
    init_method: str | None,
    backend: str,
    *,
    timeout: timedelta | None = None,
) -> None:
    """Join the tensor-parallel group as `rank` of `world_size`.

    `init_method` is torch.distributed's rendezvous ("tcp://127.0.0.1:29500"), the same on
    every rank; `backend` is "gloo" for CPU tensors, "nccl" for CUDA ones (a CUDA worker
    selects its device with `torch.cuda.set_device` first). A world of one opens no
    process group (`init_method` may be None). `timeout` bounds how long a collective
    waits for a rank that never comes (torch's default otherwise).
    """
    global _group
    if _group is not None:
        raise RuntimeError("tensor parallelism is already initialised in this process.")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a tensor-parallel group of {world_size}.")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}.")
    if world_size > 1:
        if init_method is None:
            raise ValueError(f"{world_size} ranks need an init_method to meet at.")
        kwargs = {"timeout": timeout} if timeout is not None else {}
        dist.init_process_group(
            backend, init_method=init_method, world_size=world_size, rank=rank, **kwargs
        )
    _group = TensorParallelGroup(rank=rank, world_size=world_size)


def destroy_tensor_parallel() -> None:
    """Leave the group (idempotent); afterwards this process is a single rank again."""
    global _group
    if _group is not None and _group.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _group = None


def get_tp_group() -> TensorParallelGroup:
    """This process's group; rank 0 of 1 when `init_tensor_parallel` was never called."""
    return _group if _group is not None else _SINGLE_RANK
