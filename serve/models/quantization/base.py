"""What every quantized-checkpoint format shares: the per-layer parameters it registers,
reading its packed tensors by the layer's sharding, and unpacking int32 words.

A format (gptq.py, awq.py, fp8.py, compressed_tensors.py) is a `QuantFormat`: it names
the checkpoint tensors of a quantized linear layer (their suffixes: `qweight`, `scales`,
...), registers a parameter under each name on the layer, in the layout of
`serve.kernels.packed_weight` and sharded as the layer is, with a weight loader that
converts the checkpoint's tensor into it, and finally hands the layer its `PackedWeight`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from serve.kernels.packed_weight import PackedWeight
from serve.models.layers.linear import LinearSharding, OutputShard
from serve.models.lazy_tensor import LazyTensor, as_lazy

# Converts one checkpoint tensor (already narrowed to this rank's part) into the layout
# of the parameter it feeds, for the rows of one output shard.
Convert = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Groups:
    """The quantization groups along a layer's inputs that this rank keeps: groups
    [first, first + count) of the checkpoint's, each `size` inputs."""

    size: int
    first: int
    count: int


class QuantFormat:
    """One checkpoint format's quantized linear layers. Subclasses set `method` (the
    `quant_method` of config.json's `quantization_config`) and implement the three
    methods below; `marker` is the tensor suffix that says a module is quantized."""

    method: str = ""
    marker: str = ""
    # checkpoint tensor suffixes read and dropped (activation scales of schemes that
    # serve runs weight-only)
    dropped: tuple[str, ...] = ()

    def describe(self) -> str:
        """The scheme in a few words, for the start-up log."""
        return self.method

    def register(self, layer: nn.Module, sharding: LinearSharding, suffixes: set[str]) -> None:
        """Replace the layer's float `weight` with this format's parameters; `suffixes`
        are the tensor names the checkpoint holds for the layer's modules."""
        raise NotImplementedError

    def packed(self, layer: nn.Module) -> PackedWeight:
        """The layer's weight once every parameter is loaded."""
        raise NotImplementedError


def quantized_parameter(
    layer: nn.Module,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    load: Callable[[LazyTensor, OutputShard], torch.Tensor],
    sharding: LinearSharding,
) -> None:
    """Register `name` on `layer`, filled shard by shard: `load(checkpoint tensor, rows)`
    returns this rank's part of one checkpoint tensor, [rows' local count, ...], which is
    copied to the rows the shard occupies in the layer."""
    param = nn.Parameter(
        torch.empty(shape, dtype=dtype, device=layer.quant_device), requires_grad=False
    )

    def weight_loader(
        param: nn.Parameter, loaded: LazyTensor | torch.Tensor, shard_name: str | None = None
    ) -> None:
        if shard_name not in sharding.outputs:
            raise ValueError(f"no shard {shard_name!r} here; shards: {list(sharding.outputs)}")
        offset, rows = sharding.outputs[shard_name]
        part = load(as_lazy(loaded), rows)
        if part.shape[0] != rows.num_local_rows or part.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"{name}: this rank's part has shape {tuple(part.shape)}, expected "
                f"{(rows.num_local_rows, *param.shape[1:])}"
            )
        param.data.narrow(0, offset, rows.num_local_rows).copy_(part)

    param.weight_loader = weight_loader
    layer.register_parameter(name, param)


def replicated_parameter(
    layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, load: Convert
) -> None:
    """Register `name` on `layer`: one tensor for the whole layer, every output shard's
    copy the same (GPTQ's `g_idx`: q, k and v, or gate and up, read the same inputs, so
    act order sorts them alike); a ValueError where a shard's copy differs."""
    param = nn.Parameter(
        torch.empty(shape, dtype=dtype, device=layer.quant_device), requires_grad=False
    )
    loaded_shards: list[str | None] = []

    def weight_loader(
        param: nn.Parameter, loaded: LazyTensor | torch.Tensor, shard_name: str | None = None
    ) -> None:
        part = load(as_lazy(loaded).load())
        if tuple(part.shape) != tuple(param.shape):
            raise ValueError(f"{name}: shape {tuple(part.shape)}, expected {tuple(param.shape)}")
        if loaded_shards and not torch.equal(param.data, part.to(param.device)):
            raise ValueError(
                f"{name} of shard {shard_name!r} differs from that of {loaded_shards[0]!r}, "
                "which serve runs as one layer"
            )
        param.data.copy_(part)
        loaded_shards.append(shard_name)

    param.weight_loader = weight_loader
    layer.register_parameter(name, param)


def drop_float_weight(layer: nn.Module) -> None:
    """The layer's float weight is replaced by packed parameters, made where it was."""
    layer.quant_device = layer.weight.device
    del layer.weight


def aligned(start: int, length: int, unit: int, what: str, total: int) -> tuple[int, int]:
    """[start, start + length) in units of `unit` (a packed word's values, a group, a
    block); a ValueError where a rank's part does not fall on whole units."""
    if start % unit or (length % unit and start + length != total):
        raise ValueError(
            f"{what}: this rank's part [{start}, {start + length}) does not fall on whole "
            f"units of {unit}; choose a tensor_parallel_size that splits it on them"
        )
    return start // unit, -(-length // unit)


def groups_for(sharding: LinearSharding, group_size: int, keep_all: bool) -> Groups:
    """The groups along the inputs this rank keeps: its own inputs' (aligned to whole
    groups), or all of them (`keep_all`: GPTQ's act order, whose groups are scattered
    over the inputs). A group size of -1 or 0 is one group over all inputs."""
    total = sharding.in_features
    size = total if group_size <= 0 else group_size
    num_groups = -(-total // size)
    if keep_all or num_groups == 1:
        return Groups(size, 0, num_groups)
    first, count = aligned(
        sharding.input_start, sharding.num_local_inputs, size, "quantization groups", total
    )
    return Groups(size, first, count)


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits values each, the first in the lowest bits, unpacked
    along `dim` (which grows by 32 / bits): values 0 .. 2**bits - 1 as int32."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    dim %= words.dim()
    shape = [1] * (words.dim() + 1)
    shape[dim + 1] = per_word
    values = (words.unsqueeze(dim + 1) >> shifts.view(shape)) & ((1 << bits) - 1)
    return values.flatten(dim, dim + 1)


def input_groups(
    layer: nn.Module, g_idx: torch.Tensor | None, groups: Groups, what: str
) -> torch.Tensor | None:
    """A layer's act-order group of each input (`g_idx`, local to the groups this rank
    keeps), or None where the inputs are in order (each input's group `i // size`, which
    the kernels take without a lookup); a ValueError for a group this rank does not hold."""
    if g_idx is None:
        return None
    start = layer.sharding().input_start
    in_order = (torch.arange(g_idx.shape[0], device=g_idx.device) + start) // groups.size
    if start == groups.first * groups.size and torch.equal(g_idx, in_order - groups.first):
        return None
    if bool((g_idx < 0).any() or (g_idx >= groups.count).any()):
        raise ValueError(f"{what} names groups outside [0, {groups.count}) at this rank")
    return g_idx
