"""compressed-tensors checkpoints (`quant_method: "compressed-tensors"`): what llm-compressor
saves, RedHatAI's and neuralmagic's `-quantized.w4a16`, `-quantized.w8a16`, `-FP8-dynamic`,
`-FP8` and `-quantized.w8a8` models.

config.json's `quantization_config.config_groups` holds schemes, each with `targets`
(module classes or `re:` patterns), `weights`, `input_activations` (and
`output_activations`) quantization arguments; `ignore` lists the modules left float;
`format` (per group, or for the whole checkpoint) says how a quantized weight is saved.
serve decides per module from the tensors (a module holding `weight_packed` or
`weight_scale` is quantized), so it reads one weight scheme for all of them. Per quantized
linear layer with `in` inputs and `out` outputs, `b`-bit integers (`b` = 4 or 8, a word
holding `p = 32 / b` values) or FP8:

| format            | tensor              | shape, dtype                | holds                  |
|-------------------|---------------------|-----------------------------|------------------------|
| `pack-quantized`  | `weight_packed`     | int32 [out, in / p]         | q + 2**(b-1), packed   |
|                   |                     |                             | along the inputs, the  |
|                   |                     |                             | first in the low bits  |
|                   | `weight_zero_point` | int32 [out / p, G] (asym.)  | z + 2**(b-1), packed   |
|                   |                     |                             | along the OUTPUTS      |
|                   | `weight_g_idx`      | int32 [in] (act order)      | each input's group     |
|                   | `weight_shape`      | int64 [2]                   | [out, in]: not needed  |
| `int-quantized`,  | `weight`            | int8 [out, in]              | q                      |
| `naive-quantized` | `weight_zero_point` | int8, as the scale (asym.)  | z                      |
| `float-quantized` | `weight`            | float8_e4m3fn [out, in]     | q                      |
| all               | `weight_scale`      | per tensor [1], channel     | s                      |
|                   |                     | [out, 1], group [out, G],   |                        |
|                   |                     | block [out / bo, in / bi]   |                        |

w[o, i] = (q[o, i] - z) * s, q and z signed (z = 0 where symmetric). The packed layout's
unsigned values are packed_weight's codes as they are, with zeros z + 2**(b-1) (2**(b-1)
where symmetric): the difference is the same.

serve runs every scheme weight-only: activations stay in the model's dtype (what vLLM does
on GPUs without the matching int8 or FP8 matmul), so static activation scales
(`input_scale`, `input_zero_point`) and KV-cache scales are read and not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from serve.kernels.packed_weight import PackedWeight, pack_uint4
from serve.models.layers.linear import LinearSharding, OutputShard
from serve.models.lazy_tensor import LazyTensor
from serve.models.quantization.base import (
    QuantFormat,
    aligned,
    drop_float_weight,
    groups_for,
    input_groups,
    quantized_parameter,
    replicated_parameter,
    unpack_int32,
)

PACKED = "pack-quantized"
UNPACKED = ("int-quantized", "naive-quantized", "float-quantized")
# Formats llm-compressor writes that serve does not read, with what they are.
REFUSED_FORMATS = {
    "dense": "float weights with the quantization config only (not compressed)",
    "sparse-bitmask": "sparse weights",
    "sparse-24-bitmask": "2:4 sparse weights",
    "marlin-24": "2:4 sparse weights in Marlin's layout",
    "nvfp4-pack-quantized": "NVFP4 weights",
    "mxfp4-pack-quantized": "MXFP4 weights",
    "mxfp6-pack-quantized": "MXFP6 weights",
    "mxfp8-quantized": "MXFP8 weights",
    "mixed-precision": "each config group names its own, and this one names none",
    "fakequant": "float weights with the quantization config only (not compressed)",
}


@dataclass(frozen=True)
class WeightScheme:
    """The one weight scheme of a checkpoint's quantized modules."""

    format: str
    type: str  # "int" or "float"
    bits: int
    symmetric: bool
    strategy: str  # "tensor", "channel", "group" or "block"
    group_size: int  # inputs per group for "group"; 0 otherwise
    block: tuple[int, int] | None  # (rows, columns) for "block"
    act_order: bool  # actorder "group": the checkpoint holds weight_g_idx


def _strategy(weights: dict[str, Any]) -> str:
    """The scheme's strategy, inferred as compressed-tensors infers it where unset."""
    strategy = weights.get("strategy")
    if strategy is not None:
        return str(strategy).lower()
    group_size = weights.get("group_size")
    if group_size is None:
        return "tensor"
    return "channel" if int(group_size) == -1 else "group"


def _weight_scheme(name: str, group: Any, default_format: str | None) -> WeightScheme:
    """Group `name`'s weight scheme; a ValueError naming what serve does not read."""
    if not isinstance(group, dict):
        raise ValueError(
            f"compressed-tensors config group {name!r} is {group!r}, a preset name's targets; "
            "serve reads the expanded schemes llm-compressor saves"
        )
    weights = group.get("weights")
    if not weights:
        raise ValueError(
            f"compressed-tensors config group {name!r} quantizes activations only (no "
            "weights), which serve does not read"
        )
    if group.get("output_activations"):
        raise ValueError(
            f"compressed-tensors config group {name!r} quantizes output activations, which "
            "serve does not read"
        )
    fmt = group.get("format") or default_format
    if fmt is None:
        raise ValueError(
            f"compressed-tensors config group {name!r} names no format (nor does the config)"
        )
    if fmt in REFUSED_FORMATS or (fmt != PACKED and fmt not in UNPACKED):
        what = f" ({REFUSED_FORMATS[fmt]})" if fmt in REFUSED_FORMATS else ""
        raise ValueError(
            f"compressed-tensors format {fmt!r}{what}: serve reads {PACKED}, {', '.join(UNPACKED)}"
        )
    kind, bits = str(weights.get("type", "int")).lower(), int(weights.get("num_bits", 8))
    strategy = _strategy(weights)
    if kind == "float" and bits != 8:
        raise ValueError(
            f"compressed-tensors {bits}-bit float weights (NVFP4, MXFP4): serve reads FP8 "
            "(e4m3) and 4- and 8-bit integer weights"
        )
    if kind not in ("int", "float") or (kind == "int" and bits not in (4, 8)):
        raise ValueError(
            f"compressed-tensors {bits}-bit {kind} weights: serve reads FP8 (e4m3) and 4- and "
            "8-bit integer weights"
        )
    if (kind == "float") != (fmt == "float-quantized") and fmt != "naive-quantized":
        raise ValueError(f"compressed-tensors {kind} weights in {fmt!r}: not a layout they have")
    supported = ("tensor", "channel", "group") + (("block",) if kind == "float" else ())
    if strategy not in supported:
        raise ValueError(
            f"compressed-tensors {kind} weights with strategy {strategy!r}: serve reads "
            f"{', '.join(supported)}"
        )
    if weights.get("dynamic"):
        raise ValueError(
            "compressed-tensors weights quantized dynamically: serve reads saved scales"
        )
    symmetric = bool(weights.get("symmetric", True))
    if kind == "float" and not symmetric:
        raise ValueError("compressed-tensors asymmetric FP8 weights: serve reads symmetric ones")
    group_size = int(weights.get("group_size") or 0) if strategy == "group" else 0
    if strategy == "group" and group_size <= 0:
        raise ValueError(f"compressed-tensors group strategy with group_size {group_size}")
    block = None
    if strategy == "block":
        structure = weights.get("block_structure")
        if isinstance(structure, str):  # the older "128x128" spelling
            structure = structure.split("x")
        if not structure or len(structure) != 2 or min(int(b) for b in structure) < 1:
            raise ValueError(
                f"compressed-tensors block_structure {structure}: expected [rows, columns]"
            )
        block = (int(structure[0]), int(structure[1]))
    actorder = weights.get("actorder")
    # actorder "weight" ("static") only orders the quantizer's work: the saved layout is the
    # plain one. "group" ("dynamic", or True in old configs) saves each input's group in
    # weight_g_idx; with one group a row, every input's group is 0 whatever the order.
    act_order = actorder is True or str(actorder).lower() in ("group", "dynamic")
    act_order = act_order and fmt == PACKED and strategy == "group"
    return WeightScheme(fmt, kind, bits, symmetric, strategy, group_size, block, act_order)


def _refuse_extras(config: dict[str, Any]) -> None:
    """A ValueError for the parts of the config serve does not read."""
    sparsity = config.get("sparsity_config") or {}
    sparse_format = sparsity.get("format", "dense") if isinstance(sparsity, dict) else "dense"
    if sparse_format not in (None, "dense"):
        structure = sparsity.get("sparsity_structure")
        raise ValueError(
            f"compressed-tensors sparsity ({sparse_format!r}"
            + (f", {structure}" if structure else "")
            + "): serve reads dense quantized checkpoints"
        )
    if config.get("transform_config"):
        raise ValueError(
            "compressed-tensors transform_config (rotations such as QuIP's or SpinQuant's): "
            "serve does not apply them"
        )


class CompressedTensorsFormat(QuantFormat):
    method = "compressed-tensors"

    def __init__(self, config: dict[str, Any]) -> None:
        _refuse_extras(config)
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError("a compressed-tensors quantization_config with no config_groups")
        default_format = config.get("format")
        schemes = {
            name: _weight_scheme(name, group, default_format) for name, group in groups.items()
        }
        # The tensors say which modules are quantized, not which group each is in: more than
        # one scheme would leave serve guessing each module's.
        first, *others = schemes.items()
        for name, scheme in others:
            if scheme != first[1]:
                raise ValueError(
                    f"compressed-tensors config groups {first[0]!r} and {name!r} quantize "
                    f"modules differently ({_describe(first[1])}; {_describe(scheme)}): serve "
                    "reads checkpoints with one weight scheme for every quantized module"
                )
        self.scheme = first[1]
        self.activations = any(group.get("input_activations") for group in groups.values())
        self.marker = "weight_packed" if self.scheme.format == PACKED else "weight_scale"
        dropped = ["input_scale", "input_zero_point"]
        if self.scheme.format == PACKED:
            dropped.append("weight_shape")  # the model's layer says the shape
        if config.get("kv_cache_scheme"):
            # KV-cache scales: serve's cache stays in the model's dtype. Older llm-compressor
            # saved them as k_proj's and v_proj's output scales.
            dropped += ["k_scale", "v_scale", "k_zero_point", "v_zero_point"]
            dropped += ["output_scale", "output_zero_point"]
        self.dropped = tuple(dropped)
        self.per_word = 32 // self.scheme.bits

    def describe(self) -> str:
        # activations quantized by the checkpoint's scheme stay in the model's dtype here
        weight_only = ", run weight-only" if self.activations else ""
        return f"compressed-tensors {_describe(self.scheme)}{weight_only}"

    def register(self, layer: nn.Module, sharding: LinearSharding, suffixes: set[str]) -> None:
        drop_float_weight(layer)
        scheme = self.scheme
        out, start, n_in = (
            sharding.num_local_outputs,
            sharding.input_start,
            sharding.num_local_inputs,
        )
        total_in = sharding.in_features
        # tensor and channel: one scale a row over all inputs; block: its columns' groups.
        # Act order scatters a group's inputs over all ranks' inputs: each rank keeps all.
        group_size = scheme.block[1] if scheme.block else scheme.group_size
        act_order = scheme.act_order or "weight_g_idx" in suffixes
        groups = groups_for(sharding, group_size, keep_all=act_order)
        layer.quant_groups = groups
        offset = 1 << (scheme.bits - 1)  # the codes are q + offset, unsigned

        def weight_packed(loaded: LazyTensor, rows: OutputShard) -> torch.Tensor:
            words = loaded.narrow(0, rows.start, rows.num_local_rows)
            if words.dtype != torch.int32:
                raise ValueError(f"weight_packed is {words.dtype}, not int32")
            if n_in != total_in:
                first, count = aligned(
                    start, n_in, self.per_word, "compressed-tensors weight_packed", total_in
                )
                words = words.narrow(1, first, count)
            codes = unpack_int32(words, scheme.bits, dim=1)[:, :n_in]  # already q + offset
            return pack_uint4(codes) if scheme.bits == 4 else codes.to(torch.uint8)

        def weight(loaded: LazyTensor, rows: OutputShard) -> torch.Tensor:
            part = loaded.narrow(0, rows.start, rows.num_local_rows).narrow(1, start, n_in)
            expected = torch.int8 if scheme.type == "int" else torch.float8_e4m3fn
            if part.dtype != expected:
                raise ValueError(f"a quantized layer's weight is {part.dtype}, not {expected}")
            if scheme.type == "float":
                return part
            return (part.to(torch.int16) + offset).to(torch.uint8)

        def per_row(loaded: LazyTensor, rows: OutputShard, what: str) -> torch.Tensor:
            """This rank's [rows, groups] of a scale or an unpacked zero point, float32."""
            if scheme.strategy == "tensor":
                value = loaded.load().float().reshape(-1)
                if value.numel() != 1:
                    raise ValueError(f"a per-tensor {what} has {value.numel()} values")
                return value.expand(rows.num_local_rows).reshape(-1, 1)
            if scheme.block is not None:  # [out / bo, in / bi]: repeat each block's row
                block_rows = scheme.block[0]
                first_row, row_blocks = aligned(
                    rows.start, rows.num_local_rows, block_rows, f"{what} blocks", rows.num_rows
                )
                part = loaded.narrow(0, first_row, row_blocks)
                part = part.narrow(1, groups.first, groups.count).float()
                skip = rows.start - first_row * block_rows
                part = part.repeat_interleave(block_rows, dim=0)
                return part[skip : skip + rows.num_local_rows]
            part = loaded.narrow(0, rows.start, rows.num_local_rows)
            return part.narrow(1, groups.first, groups.count).float()

        def weight_scale(loaded: LazyTensor, rows: OutputShard) -> torch.Tensor:
            return per_row(loaded, rows, "weight_scale")

        def packed_zero_point(loaded: LazyTensor, rows: OutputShard) -> torch.Tensor:
            first, count = aligned(
                rows.start,
                rows.num_local_rows,
                self.per_word,
                "compressed-tensors weight_zero_point",
                rows.num_rows,
            )
            words = loaded.narrow(0, first, count).narrow(1, groups.first, groups.count)
            zeros = unpack_int32(words, scheme.bits, dim=0)  # [~rows, groups], z + offset
            skip = rows.start - first * self.per_word
            return zeros[skip : skip + rows.num_local_rows].float()

        def zero_point(loaded: LazyTensor, rows: OutputShard) -> torch.Tensor:
            return per_row(loaded, rows, "weight_zero_point") + offset

        if scheme.format == PACKED:
            cols = -(-n_in // 2) if scheme.bits == 4 else n_in
            quantized_parameter(
                layer, "weight_packed", (out, cols), torch.uint8, weight_packed, sharding
            )
        else:
            dtype = torch.uint8 if scheme.type == "int" else torch.float8_e4m3fn
            quantized_parameter(layer, "weight", (out, n_in), dtype, weight, sharding)
        shape = (out, groups.count)
        quantized_parameter(layer, "weight_scale", shape, torch.float32, weight_scale, sharding)
        if "weight_zero_point" in suffixes:
            # Only an asymmetric pack-quantized scheme's group or channel zero points are
            # packed; others are saved as the integers they are (a symmetric scheme's zeros
            # too, in versions that saved them).
            packed = scheme.format == PACKED and scheme.strategy in ("group", "channel")
            load = packed_zero_point if packed and not scheme.symmetric else zero_point
            quantized_parameter(layer, "weight_zero_point", shape, torch.float32, load, sharding)
        elif not scheme.symmetric:
            raise ValueError("an asymmetric compressed-tensors scheme without weight_zero_point")
        if "weight_g_idx" in suffixes:

            def g_idx(loaded: torch.Tensor) -> torch.Tensor:
                return loaded.narrow(0, start, n_in).long() - groups.first

            replicated_parameter(layer, "weight_g_idx", (n_in,), torch.int64, g_idx)

    def packed(self, layer: nn.Module) -> PackedWeight:
        scheme = self.scheme
        n_in, groups = layer.num_local_inputs, layer.quant_groups
        zeros = getattr(layer, "weight_zero_point", None)
        if scheme.type == "int" and zeros is None:
            # symmetric: the codes are q + 2**(b-1), so the zero point is that offset
            zeros = torch.full_like(layer.weight_scale, float(1 << (scheme.bits - 1)))
        g_idx = getattr(layer, "weight_g_idx", None)
        if g_idx is not None:
            g_idx = input_groups(layer, g_idx, groups, "compressed-tensors weight_g_idx")
        elif scheme.act_order:
            raise ValueError(
                "a compressed-tensors checkpoint with actorder 'group' must hold weight_g_idx"
            )
        if scheme.format == PACKED:
            kind, codes = ("uint4" if scheme.bits == 4 else "uint8"), layer.weight_packed
        else:
            kind, codes = ("fp8" if scheme.type == "float" else "uint8"), layer.weight
        return PackedWeight(
            kind=kind,
            codes=codes,
            scales=layer.weight_scale,
            zeros=zeros,
            group_size=groups.size,
            in_features=n_in,
            g_idx=g_idx,
        )


def _describe(scheme: WeightScheme) -> str:
    weights = "FP8 (e4m3)" if scheme.type == "float" else f"{scheme.bits}-bit integer"
    if scheme.strategy == "group":
        scales = f"groups of {scheme.group_size}"
    elif scheme.strategy == "block" and scheme.block is not None:
        scales = f"blocks of {scheme.block[0]}x{scheme.block[1]}"
    else:
        scales = f"per {scheme.strategy}"
    symmetry = "" if scheme.symmetric else ", asymmetric"
    order = ", act order" if scheme.act_order else ""
    return f"{scheme.format} {weights} weights, {scales}{symmetry}{order}"
