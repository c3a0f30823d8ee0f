"""Linear layers split over the tensor-parallel ranks, each loading only its rank's slice.

The Megatron pairing: a column-parallel layer splits its output features (no
communication; each rank computes its own heads / intermediate columns), and the
row-parallel layer after it splits its input features and all-reduces the partial sums.
So an attention block or an MLP costs one all-reduce.

Every parameter carries `weight_loader(param, loaded, shard_name=None)`: `loaded` is a
checkpoint tensor (a `LazyTensor`, or a plain tensor) of the full, unsharded shape, and
the loader reads only the rows or columns this rank holds. Fused layers (q/k/v,
gate/up) take one checkpoint tensor per named shard. Layers read the rank and world size
from `get_tp_group()` when constructed: build them after `init_tensor_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from serve import kernels
from serve.distributed.parallel_state import get_tp_group
from serve.kernels.packed_weight import PackedWeight
from serve.models.layers.lora import LoRAShard, LoRASlots, current_lora_batch
from serve.models.lazy_tensor import LazyTensor, as_lazy
from serve.models.partition import first_kv_head, num_kv_heads_per_rank, split_evenly


def _parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape), requires_grad=False)


@dataclass(frozen=True)
class LinearSharding:
    """Which part of the checkpoint's weights this rank's layer holds: for each output
    shard, the rows (`OutputShard`) and where they sit in the layer (`offset`); and the
    input columns [input_start, input_start + num_local_inputs) of `in_features`. A
    quantized layer reads its packed tensors by it."""

    outputs: dict[str | None, tuple[int, OutputShard]]  # shard name -> (offset, rows)
    in_features: int
    input_start: int
    num_local_inputs: int

    @property
    def num_local_outputs(self) -> int:
        return sum(shard.num_local_rows for _, shard in self.outputs.values())


def _matmul(
    layer: ReplicatedLinear | _ColumnShardedLinear | RowParallelLinear,
    x: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x W^T (+ bias) by the layer's weight: its float `weight`, or the packed weight a
    quantized checkpoint gave it (`serve.models.quantization`)."""
    if layer.packed_weight is None:
        return kernels.linear(x, layer.weight, bias)
    return kernels.quantized_linear(x, layer.packed_weight, bias)


def _with_lora(
    layer: ReplicatedLinear | _ColumnShardedLinear | RowParallelLinear,
    x: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """`out` plus the step's adapter updates, where the layer has slots and the step uses
    adapters."""
    batch = current_lora_batch()
    return out if batch is None else layer.lora.add(x, out, batch)


def _check_lora_shapes(a: torch.Tensor, b: torch.Tensor, in_features: int, rows: int) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(
            f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a rank-r pair"
        )
    if a.shape[1] != in_features or b.shape[0] != rows:
        raise ValueError(
            f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a layer of "
            f"{in_features} inputs and {rows} outputs (expected [r, {in_features}] and "
            f"[{rows}, r])"
        )


def check_checkpoint_shape(loaded: LazyTensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"{what}: checkpoint shape {tuple(loaded.shape)} does not match the expected "
            f"(unsharded) shape {tuple(expected)}"
        )


def default_weight_loader(
    param: nn.Parameter, loaded: LazyTensor | torch.Tensor, shard_name: str | None = None
) -> None:
    """A replicated parameter: every rank reads the whole checkpoint tensor."""
    if shard_name is not None:
        raise ValueError(f"a replicated parameter has no shard {shard_name!r}")
    loaded = as_lazy(loaded)
    check_checkpoint_shape(loaded, tuple(param.shape), "weight")
    param.data.copy_(loaded.load())


class ReplicatedLinear(nn.Module):
    """The whole weight on every rank: for layers too small or too odd to split."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _parameter(out_features, in_features)
        self.weight.weight_loader = default_weight_loader
        self.bias = _parameter(out_features) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader
        self.in_features, self.out_features = in_features, out_features
        self.packed_weight: PackedWeight | None = None  # set by a quantized checkpoint
        self.lora: LoRASlots | None = None  # the worker's LoRA manager attaches them

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        out = _matmul(self, x, self.bias)
        return out if self.lora is None else _with_lora(self, x, out)

    @property
    def num_local_inputs(self) -> int:
        return self.in_features

    def sharding(self) -> LinearSharding:
        whole = OutputShard(None, self.out_features, 0, self.out_features)
        return LinearSharding({None: (0, whole)}, self.in_features, 0, self.in_features)

    def lora_shards(self) -> list[LoRAShard]:
        return [LoRAShard(None, 0, self.out_features)]

    def lora_slices(
        self, shard: str | None, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's A [r, in] and B [out, r] for this layer: the parts this rank holds."""
        if shard is not None:
            raise ValueError(f"a replicated layer has no shard {shard!r}")
        _check_lora_shapes(a, b, self.in_features, self.out_features)
        return a, b


@dataclass(frozen=True)
class OutputShard:
    """The output rows of one checkpoint tensor (q_proj, gate_proj, ...) this rank holds."""

    name: str | None  # the shard name weight loaders are called with; None: unfused
    num_rows: int  # the checkpoint tensor's rows, all ranks together
    start: int  # the first checkpoint row this rank holds
    num_local_rows: int


def _even_shard(name: str | None, num_rows: int) -> OutputShard:
    tp = get_tp_group()
    num_local_rows = split_evenly(num_rows, tp.world_size, name or "out_features")
    return OutputShard(name, num_rows, tp.rank * num_local_rows, num_local_rows)


class _ColumnShardedLinear(nn.Module):
    """Output features split over ranks; one or more checkpoint tensors stacked.

    This rank's weight is its shards' row ranges stacked in order, [sum of local rows, in]:
    for q/k/v at rank r, [q rows of r; k rows of r; v rows of r]. The output stays split
    (no communication): `split` cuts it into the shards.
    """

    def __init__(self, in_features: int, shards: list[OutputShard], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = [s.num_local_rows for s in shards]
        offsets = [sum(self.output_sizes[:i]) for i in range(len(shards))]
        self._shards = {s.name: (offset, s) for s, offset in zip(shards, offsets)}
        self.weight = _parameter(sum(self.output_sizes), in_features)
        self.weight.weight_loader = self.weight_loader
        self.bias = _parameter(sum(self.output_sizes)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

        self.packed_weight: PackedWeight | None = None  # set by a quantized checkpoint
        self.lora: LoRASlots | None = None  # the worker's LoRA manager attaches them

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, sum(output_sizes)]
        out = _matmul(self, x, self.bias)
        return out if self.lora is None else _with_lora(self, x, out)

    @property
    def num_local_inputs(self) -> int:
        return self.in_features

    def sharding(self) -> LinearSharding:
        return LinearSharding(dict(self._shards), self.in_features, 0, self.in_features)

    def lora_shards(self) -> list[LoRAShard]:
        return [
            LoRAShard(name, offset, shard.num_local_rows)
            for name, (offset, shard) in self._shards.items()
        ]

    def lora_slices(
        self, shard: str | None, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's A [r, in] and B [shard's rows, r] for one shard of this layer (all
        ranks' rows): A whole, and the rows of B this rank holds."""
        if shard not in self._shards:
            raise ValueError(
                f"this model's checkpoint holds the layer as separate modules "
                f"({', '.join(map(str, self._shards))}); the adapter must adapt those"
                if shard is None
                else f"no shard {shard!r} here; shards: {list(self._shards)}"
            )
        _, part = self._shards[shard]
        _check_lora_shapes(a, b, self.in_features, part.num_rows)
        return a, b.narrow(0, part.start, part.num_local_rows)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.split(self.output_sizes, dim=-1)

    def weight_loader(
        self, param: nn.Parameter, loaded: LazyTensor | torch.Tensor, shard_name: str | None = None
    ) -> None:
        if shard_name not in self._shards:
            raise ValueError(f"no shard {shard_name!r} here; shards: {list(self._shards)}")
        offset, shard = self._shards[shard_name]
        loaded = as_lazy(loaded)
        what = shard_name or "weight"
        check_checkpoint_shape(loaded, (shard.num_rows, *param.shape[1:]), what)
        rows = loaded.narrow(0, shard.start, shard.num_local_rows)
        param.data.narrow(0, offset, shard.num_local_rows).copy_(rows)


class ColumnParallelLinear(_ColumnShardedLinear):
    """y_r = x W_r^T: rank r holds output rows [r * out / tp, (r + 1) * out / tp)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, [_even_shard(None, out_features)], bias)


class MergedColumnParallelLinear(_ColumnShardedLinear):
    """Several projections of the same input in one matmul (gate/up), each split evenly:
    rank r's output is [gate_r | up_r], ready for SiluAndMul."""

    def __init__(
        self, in_features: int, output_sizes: list[int], shard_names: list[str], bias: bool = False
    ) -> None:
        shards = [_even_shard(name, size) for name, size in zip(shard_names, output_sizes)]
        super().__init__(in_features, shards, bias)


class QKVParallelLinear(_ColumnShardedLinear):
    """q/k/v in one matmul, split by heads. Query heads split evenly; KV heads split evenly,
    or are replicated when there are more ranks than KV heads (partition.py's table).

    `num_heads` / `num_kv_heads` are this rank's counts.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp = get_tp_group()
        num_local_heads = split_evenly(num_heads, tp.world_size, "num_attention_heads")
        if num_kv_heads % tp.world_size and tp.world_size % num_kv_heads:
            raise ValueError(
                f"num_key_value_heads {num_kv_heads} and tensor_parallel_size {tp.world_size}: "
                "neither divides the other."
            )
        num_local_kv_heads = num_kv_heads_per_rank(num_kv_heads, tp.world_size)
        kv_start = first_kv_head(num_kv_heads, tp.world_size, tp.rank) * head_dim
        q_rows, kv_rows = num_local_heads * head_dim, num_local_kv_heads * head_dim
        shards = [
            OutputShard("q", num_heads * head_dim, tp.rank * q_rows, q_rows),
            OutputShard("k", num_kv_heads * head_dim, kv_start, kv_rows),
            OutputShard("v", num_kv_heads * head_dim, kv_start, kv_rows),
        ]
        super().__init__(hidden_size, shards, bias)
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = num_local_heads, num_local_kv_heads


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T (+ bias): rank r holds input columns
    [r * in / tp, (r + 1) * in / tp) and takes the matching slice of x (the split output
    of the column-parallel layer before it). The partial sums are all-reduced; the bias,
    replicated, is added once, after the reduce. With `reduce_results=False` the caller
    gets this rank's partial sum and reduces it together with others (a MoE block's
    shared expert and routed experts: one all-reduce)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True
    ) -> None:
        super().__init__()
        if bias and not reduce_results:
            raise ValueError("a row-parallel layer that does not reduce cannot add its bias once")
        self.reduce_results = reduce_results
        self.tp = get_tp_group()
        self.in_features, self.out_features = in_features, out_features
        self.num_local_inputs = split_evenly(in_features, self.tp.world_size, "in_features")
        self.input_start = self.tp.rank * self.num_local_inputs
        self.weight = _parameter(out_features, self.num_local_inputs)
        self.weight.weight_loader = self.weight_loader
        self.bias = _parameter(out_features) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

        self.packed_weight: PackedWeight | None = None  # set by a quantized checkpoint
        self.lora: LoRASlots | None = None  # the worker's LoRA manager attaches them

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        if self.tp.world_size == 1 or not self.reduce_results:
            out = _matmul(self, x, self.bias)
            return out if self.lora is None else _with_lora(self, x, out)
        out = _matmul(self, x, None)
        if self.lora is not None:  # this rank's partial update, reduced with the rest
            out = _with_lora(self, x, out)
        out = self.tp.all_reduce(out)  # [T, out], summed
        return out if self.bias is None else out + self.bias

    def sharding(self) -> LinearSharding:
        whole = OutputShard(None, self.out_features, 0, self.out_features)
        return LinearSharding(
            {None: (0, whole)}, self.in_features, self.input_start, self.num_local_inputs
        )

    def lora_shards(self) -> list[LoRAShard]:
        return [LoRAShard(None, 0, self.out_features)]

    def lora_slices(
        self, shard: str | None, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's A [r, in] and B [out, r] for this layer: the columns of A of this
        rank's input slice, and B whole."""
        if shard is not None:
            raise ValueError(f"a row-parallel layer has no shard {shard!r}")
        _check_lora_shapes(a, b, self.in_features, self.out_features)
        return a.narrow(1, self.input_start, self.num_local_inputs), b

    def weight_loader(
        self, param: nn.Parameter, loaded: LazyTensor | torch.Tensor, shard_name: str | None = None
    ) -> None:
        if shard_name is not None:
            raise ValueError(f"a row-parallel weight has no shard {shard_name!r}")
        loaded = as_lazy(loaded)
        check_checkpoint_shape(loaded, (self.out_features, self.in_features), "weight")
        param.data.copy_(loaded.narrow(1, self.input_start, self.num_local_inputs))


# Every layer here: what a quantized checkpoint can pack.
LINEAR_LAYERS = (ReplicatedLinear, _ColumnShardedLinear, RowParallelLinear)
