"""Quantized checkpoints: GPTQ, AWQ, FP8 and compressed-tensors weights served as they are.

config.json's `quantization_config` names the method (`quant_method`); the format module
for it reads the method's options. Which linear layers are quantized, the checkpoint says
itself: a module whose tensors include the format's marker (GPTQ's `qweight`, FP8's
`weight_scale_inv`) is quantized, any other keeps its float weight (the LM head, a MoE
router, whatever the quantizer's ignore list named). Before the weights load,
`quantize_layers` swaps each quantized layer's float weight for the format's parameters;
after, `finish_quantized` gives each its `PackedWeight`, which `kernels.quantized_linear`
multiplies by (act order's with its inputs sorted by group where the groups are whole, so
the kernels run the grouped path on x's columns gathered). The packed weights stay packed
in memory: that is what the format saves.
`--quantization fp8` over a float checkpoint rounds its linears as they load (online.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from torch import nn

from serve.kernels.packed_weight import PackedWeight, sort_inputs_by_group
from serve.models.layers.linear import LINEAR_LAYERS
from serve.models.quantization.awq import AWQFormat
from serve.models.quantization.base import QuantFormat
from serve.models.quantization.compressed_tensors import CompressedTensorsFormat
from serve.models.quantization.fp8 import FP8Format
from serve.models.quantization.gptq import GPTQFormat
from serve.models.quantization.mxfp4 import MXFP4Format
from serve.models.weights import WeightSpec

FORMATS: dict[str, type[QuantFormat]] = {
    "gptq": GPTQFormat,
    "awq": AWQFormat,
    "fp8": FP8Format,
    "compressed-tensors": CompressedTensorsFormat,
    "mxfp4": MXFP4Format,
}
# vLLM's names for its faster kernels over the same checkpoints: one format here.
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
QUANTIZATION_METHODS = (*FORMATS, *ALIASES)


def quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """config.json's `quantization_config` as a dict, or None for float weights."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None or isinstance(config, dict):
        return config or None
    return config.to_dict()  # a transformers QuantizationConfigMixin


def checkpoint_format(hf_config: Any, requested: str | None = None) -> QuantFormat | None:
    """The checkpoint's quantization format, or None for float weights. `requested` is
    `--quantization`: it must name the checkpoint's method (or vLLM's alias for it)."""
    config = quantization_config(hf_config)
    method = None if config is None else str(config.get("quant_method", "")).lower()
    wanted = ALIASES.get(requested or "", requested)
    if method is None:
        if wanted not in (None, "fp8"):
            raise ValueError(
                f"--quantization {requested}: the checkpoint is not quantized (its config.json "
                "has no quantization_config); serve quantizes float weights while loading to "
                "fp8 only (--quantization fp8): serve a checkpoint quantized with that method"
            )
        return None  # float weights; with --quantization fp8, rounded as they load
    if method not in FORMATS:
        raise ValueError(
            f"the checkpoint is quantized with {method!r}, which serve does not read; "
            f"it reads {', '.join(FORMATS)} checkpoints"
        )
    if wanted is not None and wanted != method:
        raise ValueError(
            f"--quantization {requested}: the checkpoint is quantized with {method!r}; "
            f"leave the flag out or pass {method}"
        )
    return FORMATS[method](config)


def _module_name(checkpoint_module: str, spec: WeightSpec) -> str:
    """Our module holding a checkpoint module's weight (a fused layer for q/k/v)."""
    name = checkpoint_module + "."
    for old, new in spec.renames:
        name = name.replace(old, new)
    if spec.experts is not None:  # an expert's projection: the layer of all the experts
        match = re.match(rf"(.*\.)?{re.escape(spec.experts.module)}\.\d+\.", name)
        if match is not None:
            return (match.group(1) or "") + spec.experts.module
    for module in (*spec.fused, *spec.transposed):
        if f".{module}." in f".{name}":
            raise ValueError(
                f"{checkpoint_module}: this family's checkpoint fuses or transposes the "
                "layer, which serve reads from float weights only"
            )
    for module, (fused_module, _) in spec.packed.items():
        if f".{module}." in f".{name}":
            name = name.replace(f"{module}.", f"{fused_module}.", 1)
            break
    return name[:-1]


def quantize_layers(
    model: nn.Module, fmt: QuantFormat, checkpoint_names: Iterable[str], spec: WeightSpec
) -> list[str]:
    """Give every layer the checkpoint holds quantized the format's parameters in place of
    its float weight; the names of those layers (ours), sorted."""
    suffixes: dict[str, set[str]] = {}
    for name in checkpoint_names:
        module, _, suffix = name.rpartition(".")
        suffixes.setdefault(module, set()).add(suffix)
    layers: dict[str, set[str]] = {}
    for module, names in suffixes.items():
        if fmt.marker in names:
            layers.setdefault(_module_name(module, spec), set()).update(names)
    modules = dict(model.named_modules())
    for name, names in sorted(layers.items()):
        layer = modules.get(name)
        if hasattr(layer, "quantize_experts"):  # FusedMoE, GPT-OSS's experts: their own
            layer.quantize_experts(fmt, names)
            continue
        if not isinstance(layer, LINEAR_LAYERS):
            what = "nothing" if layer is None else f"a {type(layer).__name__}"
            raise ValueError(
                f"the checkpoint holds {name} quantized ({fmt.describe()}); in "
                f"{type(model).__name__} it is {what}, which takes float weights only"
            )
        fmt.register(layer, layer.sharding(), names)
        layer.quant_format = fmt
    if not layers:
        raise ValueError(
            f"config.json says the checkpoint is quantized ({fmt.describe()}), but no "
            f"tensor of it is (none ends in .{fmt.marker})"
        )
    return sorted(layers)


def finish_quantized(model: nn.Module) -> None:
    """Each quantized layer's `PackedWeight`, once its parameters are loaded."""
    for module in model.modules():
        fmt = getattr(module, "quant_format", None)
        if fmt is not None:
            module.packed_weight = _inputs_sorted_by_group(fmt.packed(module))


def _inputs_sorted_by_group(weight: PackedWeight) -> PackedWeight:
    """Act order's weight with its inputs sorted by group where its groups are whole
    (packed_weight.sort_inputs_by_group: the kernels' grouped path, x gathered), else as
    it is. The sorted codes are written over the layer's codes parameter, which the packed
    weight reads, so memory holds one order of them (the layer's g_idx stays the
    checkpoint's)."""
    grouped = sort_inputs_by_group(weight)
    if grouped is weight:
        return weight
    weight.codes.data.copy_(grouped.codes)
    return replace(grouped, codes=weight.codes)


def without_dropped(
    weights: Iterable[tuple[str, Any]], fmt: QuantFormat
) -> Iterable[tuple[str, Any]]:
    """The checkpoint's tensors less those the format reads and does not use."""
    for name, tensor in weights:
        if name.rpartition(".")[2] not in fmt.dropped:
            yield name, tensor
