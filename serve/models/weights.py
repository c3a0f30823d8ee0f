"""Checkpoint names onto a model's parameters, by declaration.

A model class declares a `WeightSpec`: which checkpoint tensors feed one shard of a fused
parameter (`packed`: q_proj -> the "q" shard of qkv_proj), which checkpoint tensors are
themselves fused and how they cut into our shards (`fused`: GPT-2's c_attn, BLOOM's
per-head query_key_value), which are stored transposed (GPT-2's Conv1D), renames, and what
to skip. `load_checkpoint` applies it; every parameter's `weight_loader` then reads the part
its rank holds. The cuts and the transpose are lazy views, so a tensor-parallel rank still
reads only the rows it keeps.

| checkpoint tensor        | spec                                   | reaches                                |
|--------------------------|----------------------------------------|----------------------------------------|
| `...q_proj.weight`       | `packed={"q_proj": ("qkv_proj", "q")}` | `...qkv_proj.weight`, shard "q"        |
| `...c_attn.weight` [in, 3h] | `transposed=("c_attn",)`, `fused={"c_attn": FusedRows(...)}` | `...c_attn.weight`, shards q, k, v |
| `...inv_freq`            | `ignored=(r"inv_freq$",)`              | nothing                                |
| `...experts.3.w1.weight` | `experts=ExpertTensors({"w1": ("w13_weight", "gate")})` | `...experts.w13_weight`, `ExpertShard(3, "gate")` |
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from serve.models.layers.fused_moe import ExpertShard
from serve.models.layers.linear import default_weight_loader
from serve.models.lazy_tensor import LazyTensor, as_lazy


@dataclass(frozen=True)
class FusedRows:
    """A checkpoint tensor whose rows hold several of our shards.

    The rows are `num_groups` groups, each the parts in order, part p being `parts[p][1]`
    units of `unit` rows. Plain concatenation (Phi-3's qkv, MPT's Wqkv) is one group with
    unit 1; per-head interleaving (BLOOM, GPT-NeoX: [head][q|k|v][head_dim]) is one group
    per head with unit head_dim; Falcon's grouped layout is one group per KV head holding
    its query heads, then its key and value.
    """

    parts: tuple[tuple[str, int], ...]  # (our shard name, units per group)
    num_groups: int = 1
    unit: int = 1

    @property
    def group_rows(self) -> int:
        return self.unit * sum(size for _, size in self.parts)

    def part(self, lazy: LazyTensor, name: str) -> LazyTensor:
        offset = 0
        for part_name, size in self.parts:
            if part_name == name:
                return _FusedPart(lazy, self, offset * self.unit, size * self.unit)
            offset += size
        raise KeyError(name)


class _FusedPart:
    """One part of a FusedRows tensor, as a lazy tensor of its own: [num_groups * rows, ...]."""

    def __init__(self, lazy: LazyTensor, fused: FusedRows, offset: int, rows: int) -> None:
        if lazy.shape[0] != fused.num_groups * fused.group_rows:
            raise ValueError(
                f"fused checkpoint tensor has {lazy.shape[0]} rows; its layout "
                f"({fused.num_groups} groups of {fused.group_rows}) needs "
                f"{fused.num_groups * fused.group_rows}"
            )
        self.lazy, self.fused, self.offset, self.rows = lazy, fused, offset, rows
        self.shape = (fused.num_groups * rows, *lazy.shape[1:])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim % len(self.shape) != 0:
            return self.load().narrow(dim, start, length)
        # Read only the groups that hold rows [start, start + length) of this part.
        first, last = start // self.rows, (start + length - 1) // self.rows
        group_rows = self.fused.group_rows
        groups = self.lazy.narrow(0, first * group_rows, (last - first + 1) * group_rows)
        groups = groups.reshape(last - first + 1, group_rows, *self.shape[1:])
        mine = groups[:, self.offset : self.offset + self.rows].reshape(-1, *self.shape[1:])
        return mine[start - first * self.rows :][:length]

    def load(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0])


class _Transposed:
    """A 2-D checkpoint tensor stored [in, out] (GPT-2's Conv1D), seen as [out, in]."""

    def __init__(self, lazy: LazyTensor) -> None:
        if len(lazy.shape) != 2:
            raise ValueError(f"only 2-D weights are stored transposed, got {lazy.shape}")
        self.lazy = lazy
        self.shape = (lazy.shape[1], lazy.shape[0])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.lazy.narrow(1 - dim % 2, start, length).t()

    def load(self) -> torch.Tensor:
        return self.lazy.load().t()


@dataclass(frozen=True)
class ExpertTensors:
    """Per-expert checkpoint tensors `{module}.{e}.{name}.weight`, stacked into one parameter
    per projection, `{module}.{param}`, whose loader takes `ExpertShard(e, shard)`."""

    names: Mapping[str, tuple[str, str]]  # checkpoint name -> (our stacked parameter, shard)
    module: str = "experts"

    def target(self, name: str) -> tuple[str, ExpertShard] | None:
        match = re.fullmatch(rf"(.*\.)?{re.escape(self.module)}\.(\d+)\.(\w+)\.weight", name)
        if match is None or match.group(3) not in self.names:
            return None
        param, shard = self.names[match.group(3)]
        prefix = match.group(1) or ""
        return f"{prefix}{self.module}.{param}", ExpertShard(int(match.group(2)), shard)

    def packed_target(self, name: str) -> tuple[str, str | None] | None:
        """Where a quantized checkpoint's expert tensor goes, `{module}.{e}.{name}.{suffix}`:
        expert e's own packed layer (`FusedMoE.quantize_experts`), `w13` (shards gate and up) or
        `w2`; the shard name its loader takes."""
        match = re.fullmatch(rf"(.*\.)?{re.escape(self.module)}\.(\d+)\.(\w+)\.(\w+)", name)
        if match is None or match.group(3) not in self.names:
            return None
        param, shard = self.names[match.group(3)]
        layer = param.removesuffix("_weight")
        prefix, expert, suffix = match.group(1) or "", match.group(2), match.group(4)
        return f"{prefix}{self.module}.{expert}.{layer}.{suffix}", (
            shard if layer == "w13" else None
        )


@dataclass(frozen=True)
class WeightSpec:
    """How a model's checkpoint names reach its parameters. Module names below are dotted
    fragments of a checkpoint name (`q_proj` matches `model.layers.0.self_attn.q_proj.weight`)."""

    # checkpoint module -> (our fused module, shard name)
    packed: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # checkpoint module whose tensors hold several of our shards (same module name)
    fused: Mapping[str, FusedRows] = field(default_factory=dict)
    # checkpoint modules whose 2-D weights are stored [in, out]
    transposed: tuple[str, ...] = ()
    # per-expert tensors of mixture-of-experts layers, stacked (checked before `packed`)
    experts: ExpertTensors | None = None
    # (old, new) substring renames, applied first, in order
    renames: tuple[tuple[str, str], ...] = ()
    # regular expressions of checkpoint names that feed no parameter (searched, not matched)
    ignored: tuple[str, ...] = (r"rotary_emb\.inv_freq$",)


def _has_module(name: str, module: str) -> bool:
    return f".{module}." in f".{name}"


def checkpoint_targets(
    name: str,
    tensor: LazyTensor,
    spec: WeightSpec,
    exists: Callable[[str], bool] = lambda name: False,
) -> Iterable[tuple[str, LazyTensor, str | ExpertShard | None]]:
    """(our parameter name, tensor, shard) for one checkpoint tensor, its name renamed
    first (`spec.renames`). `exists`: whether the model has a parameter of that name
    (an expert's own packed layer, where a quantized checkpoint made one)."""
    for old, new in spec.renames:
        name = name.replace(old, new)
    packed_expert = spec.experts.packed_target(name) if spec.experts is not None else None
    if packed_expert is not None and exists(packed_expert[0]):
        return [(packed_expert[0], tensor, packed_expert[1])]
    expert = spec.experts.target(name) if spec.experts is not None else None
    if expert is not None:
        return [(expert[0], tensor, expert[1])]
    for module in spec.transposed:
        if _has_module(name, module) and name.endswith(".weight"):
            tensor = _Transposed(tensor)
    for module, fused in spec.fused.items():
        if _has_module(name, module):
            return [(name, fused.part(tensor, shard), shard) for shard, _ in fused.parts]
    for module, (fused_module, shard) in spec.packed.items():
        if _has_module(name, module):
            return [(name.replace(f"{module}.", f"{fused_module}.", 1), tensor, shard)]
    return [(name, tensor, None)]


def load_checkpoint(
    model: nn.Module, weights: Iterable[tuple[str, LazyTensor | torch.Tensor]], spec: WeightSpec
) -> None:
    """Hand each checkpoint tensor to its parameter's `weight_loader`, which reads this
    rank's part of it; every parameter must be fed. A tied LM head is one parameter with
    the embedding, so the checkpoint's copy of it is skipped."""
    params = dict(model.named_parameters())  # a tied head appears once, as the embedding
    all_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    ignored = [re.compile(pattern) for pattern in spec.ignored]
    loaded: set[str] = set()
    for checkpoint_name, tensor in weights:
        if any(p.search(checkpoint_name) for p in ignored):
            continue
        targets = checkpoint_targets(checkpoint_name, as_lazy(tensor), spec, params.__contains__)
        for target, part, shard in targets:
            if target not in params:
                if target in all_names:
                    continue  # the checkpoint's copy of a tied parameter
                raise ValueError(
                    f"checkpoint tensor {checkpoint_name!r} has no place in "
                    f"{type(model).__name__} (looked for {target!r})"
                )
            param = params[target]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                weight_loader(param, part, shard)
            except ValueError as e:
                raise ValueError(
                    f"checkpoint tensor {checkpoint_name!r} -> {target}: {e}"
                ) from None
            loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(
            f"checkpoint lacks weights for: {', '.join(missing[:8])}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )
