"""LoRA adapters in PEFT's format, read and placed onto a model's linear layers.

An adapter is a folder: adapter_config.json (`r`, `lora_alpha`, `target_modules`, ...) and
adapter_model.safetensors (or .bin) with, per adapted module, `lora_A.weight` [r, in] and
`lora_B.weight` [out, r] under the base model's module name (`base_model.model.` first).
A module's checkpoint name reaches our layer, and the shard of a fused one, by the model's
own `WeightSpec`, as its weights did: `...self_attn.q_proj` is the "q" shard of
`...self_attn.qkv_proj`. `read_adapter` checks the whole adapter against the model (the
front end and the engine check it on a model built on the meta device, which has the
layers and no weights; a worker reads it onto its real layers), so an adapter that would
not load is refused before any request uses it.

Supported: LoRA (and rsLoRA's scale) on the attention and dense MLP projections of the
families built on serve's linear layers. Refused, by name: DoRA, trained biases,
`modules_to_save`, embedding and LM-head adapters, experts of mixture-of-experts layers.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from serve.lora_request import LoRARequest
from serve.models.lazy_tensor import InMemoryTensor
from serve.models.weights import WeightSpec, checkpoint_targets

_TENSOR_NAME = re.compile(
    r"base_model\.model\.(?P<module>.+)\.lora_(?P<kind>[AB])(\.default)?\.weight"
)


@dataclass(frozen=True)
class AdapterLayer:
    """One adapted part of one of our layers: A [r, in] and B [rows, r] of all ranks, B
    already scaled."""

    module: str  # our module's name in the model (`model.layers.0.self_attn.qkv_proj`)
    shard: str | None  # its shard ("q"), None for an unfused layer
    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class Adapter:
    request: LoRARequest
    rank: int  # the largest rank of its modules
    layers: list[AdapterLayer]


def is_lora_layer(module: nn.Module) -> bool:
    """One of serve's linear layers, which take LoRA slots, unless the model never runs it
    as a layer (`takes_lora` False: DeepSeek's kv_b_proj, read into other weights)."""
    return (
        hasattr(module, "lora_slices")
        and hasattr(module, "lora")
        and getattr(module, "takes_lora", True)
    )


def _fail(request: LoRARequest, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {why}")


def read_adapter_config(request: LoRARequest) -> dict[str, Any]:
    folder = Path(request.lora_path)
    if not folder.is_dir():
        raise _fail(request, "no such folder")
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise _fail(request, "the folder has no adapter_config.json (a PEFT LoRA folder)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(request, f"adapter_config.json cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise _fail(request, "adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise _fail(request, f"peft_type is {config['peft_type']!r}; only LORA adapters load")
    if config.get("use_dora"):
        raise _fail(request, "DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise _fail(request, f"bias {config['bias']!r} is not supported; only 'none'")
    if config.get("modules_to_save"):
        raise _fail(
            request,
            f"modules_to_save {config['modules_to_save']} is not supported (whole modules "
            "trained beside the adapter)",
        )
    if config.get("layers_to_transform") is not None or config.get("layer_replication"):
        raise _fail(request, "layers_to_transform / layer_replication are not supported")
    alpha = config.get("lora_alpha", config.get("r", 8))
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _fail(request, f"lora_alpha {alpha!r} is not a number")
    return config


def _adapter_tensors(request: LoRARequest) -> dict[str, torch.Tensor]:
    folder = Path(request.lora_path)
    safetensors_file = folder / "adapter_model.safetensors"
    bin_file = folder / "adapter_model.bin"
    try:
        if safetensors_file.is_file():
            from safetensors.torch import load_file

            return load_file(str(safetensors_file))
        if bin_file.is_file():
            return dict(torch.load(bin_file, map_location="cpu", weights_only=True))
    except Exception as e:  # a broken file: say which
        raise _fail(request, f"its weights cannot be read: {e}") from None
    raise _fail(request, "the folder has no adapter_model.safetensors (or adapter_model.bin)")


def _alpha(config: dict[str, Any], module: str) -> float:
    """The module's alpha: `alpha_pattern`'s entry that matches the module's name, if any,
    else `lora_alpha` (as PEFT resolves it)."""
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(value)
    return float(config.get("lora_alpha", config.get("r", 8)))


def read_adapter(request: LoRARequest, model: nn.Module, max_rank: int) -> Adapter:
    """The adapter, checked against `model`'s layers and `max_rank` (ValueError naming
    what does not fit): each adapted module's A and B, B scaled, in the model's dtype."""
    config = read_adapter_config(request)
    tensors = _adapter_tensors(request)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if "lora_embedding_" in name:
            raise _fail(request, f"{name}: embedding adapters are not supported")
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise _fail(
                request,
                f"tensor {name!r} is not a LoRA weight (base_model.model.<module>.lora_A/B."
                "weight); only LoRA on linear layers loads",
            )
        pairs.setdefault(match["module"], {})[match["kind"]] = tensor
    if not pairs:
        raise _fail(request, "it has no LoRA weights")
    spec: WeightSpec = model.weight_spec
    # Adapters are never stored transposed (PEFT keeps A and B as Linear weights even over
    # GPT-2's Conv1D); the base checkpoint's transposition does not apply.
    spec = replace(spec, transposed=())
    modules = dict(model.named_modules())
    dtype = next(model.parameters()).dtype
    use_rslora = bool(config.get("use_rslora"))
    layers: list[AdapterLayer] = []
    largest = 0
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise _fail(request, f"{module} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0] if a.dim() == 2 else 0
        if rank > max_rank:
            raise _fail(
                request,
                f"{module} has rank {rank}, above max_lora_rank {max_rank} (--max-lora-rank)",
            )
        largest = max(largest, rank)
        alpha = _alpha(config, module)
        scale = alpha / math.sqrt(rank) if use_rslora else alpha / max(rank, 1)
        targets = list(checkpoint_targets(f"{module}.weight", InMemoryTensor(b), spec))
        for target, b_part, shard in targets:
            ours = target.removesuffix(".weight")
            layer = modules.get(ours)
            if layer is None or not is_lora_layer(layer) or not target.endswith(".weight"):
                raise _fail(
                    request,
                    f"it adapts {module}, which is not one of this model's linear layers "
                    f"that take LoRA ({type(model).__name__}: the attention and dense MLP "
                    "projections)",
                )
            b_rows = b_part.load()
            try:
                layer.lora_slices(shard, a, b_rows)  # checks the shapes
            except ValueError as e:
                raise _fail(request, f"{module}: {e}") from None
            layers.append(
                AdapterLayer(ours, shard, a.to(dtype), (b_rows.float() * scale).to(dtype))
            )
    return Adapter(request, largest, layers)
