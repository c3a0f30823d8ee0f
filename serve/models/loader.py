"""Find a model's files and load its weights into one of our model classes.

Weights stream in as lazy checkpoint tensors (lazy_tensor.py); each parameter's
`weight_loader` reads the part its rank holds, so a tensor-parallel rank never holds a
full copy of a sharded weight. Which checkpoint name feeds which parameter is the model's
declaration (its `weight_spec`), applied by `weights.load_checkpoint`."""

from __future__ import annotations

import glob
import json
import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from serve.config import ModelConfig
from serve.distributed.parallel_state import get_tp_group
from serve.models.arch_config import ArchConfig
from serve.models.lazy_tensor import InMemoryTensor, LazyTensor, SafetensorsTensor
from serve.models.partition import check_tensor_parallel
from serve.models.quantization import (
    FORMATS,
    checkpoint_format,
    finish_quantized,
    quantize_layers,
    without_dropped,
)
from serve.models.quantization.online import quantize_to_fp8
from serve.models.registry import get_arch_config, get_model_class, supported_architectures
from serve.models.weights import load_checkpoint

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_model_path(model: str | None, load_format: str = "auto") -> Path:
    """A local directory with `config.json`: the default model, a converted GGUF, a local
    directory, or a repo id already in the HF cache. Never downloads."""
    from serve.models import default_model

    if model is None:
        return default_model.resolve_default_model()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return default_model.resolve_gguf(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs and (load_format == "gguf" or not (path / "config.json").exists()):
            return default_model.resolve_gguf(ggufs[0])
        if load_format == "gguf":
            raise FileNotFoundError(f"No weights (*.gguf) found in {path}.")
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"Model directory {path} has no config.json.")
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(
            f"Model {model!r} not found: it is not a local directory, a .gguf file, "
            "or an HF repo id of the form 'org/name'."
        )
    return _from_hf_cache(model)


def _from_hf_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:  # the hub raises several types for "not cached"
        raise FileNotFoundError(
            f"Model {repo_id!r} is not in the local HF cache, and serve does not download "
            f"weights. Download it first (`huggingface-cli download {repo_id}`) or pass a "
            f"local directory. ({type(e).__name__})"
        ) from None


def load_hf_config(path: Path) -> Any:
    """The model's HF config. trust_remote_code stays False: a checkpoint's `auto_map` never
    runs code here.

    A config whose `model_type` transformers does not know ships its code with the
    checkpoint (InternLM, Aquila, Baichuan, Qwen v1). When serve implements one of its
    `architectures` natively, config.json is read as plain data into a `PretrainedConfig`,
    and the model class reads its fields in its own spelling (`arch_config`)."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    data = json.loads((Path(path) / "config.json").read_text())
    quantization = data.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        if str(method).lower() not in FORMATS:
            raise ValueError(
                f"{path} is a quantized checkpoint ({method or 'quantization_config'}); serve "
                f"reads {', '.join(FORMATS)} checkpoints: serve one of those, or the model's "
                "unquantized (or GGUF) release."
            )
    model_type = data.get("model_type")
    if model_type is None or model_type in CONFIG_MAPPING:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    architectures = data.get("architectures") or []
    if not set(architectures) & set(supported_architectures()):
        raise ValueError(
            f"{path}: model_type {model_type!r} (architectures {architectures}) is not known to "
            "transformers, and serve implements none of these architectures natively; its "
            "code ships with the checkpoint, and serve never runs a checkpoint's code. "
            f"Supported architectures: {', '.join(supported_architectures())}."
        )
    return PretrainedConfig(**data)


def cpu_has_native_bf16() -> bool:
    """bf16 matmuls in hardware (AVX512_BF16 or AMX): only there does bf16 beat float32
    on a CPU; elsewhere every bf16 product is converted through float32 and runs slower."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(
    dtype: str, hf_config: Any, device: torch.device | None = None, *, log: bool = True
) -> torch.dtype:
    """The weights' dtype: `dtype` as asked; for "auto" the checkpoint's, except that a CPU
    runs a half-precision checkpoint in float32 unless it has bf16 in hardware (then bf16).
    `log`: say so (the loader does; a check before it asks quietly)."""
    on_cpu = device is not None and device.type == "cpu"
    if dtype != "auto":
        chosen = _DTYPES[dtype]
        if log and on_cpu and chosen != torch.float32 and not cpu_has_native_bf16():
            logger.warning(
                "--dtype %s on a CPU without AVX512_BF16 or AMX: every product converts "
                "through float32, so it runs slower than --dtype float32.",
                dtype,
            )
        return chosen
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype)
    chosen = config_dtype if config_dtype in _DTYPES.values() else torch.float32
    if log and config_dtype == torch.float32 and _bf16_in_hardware(device):
        logger.info(
            "The checkpoint is float32, and serve runs it so (token for token what "
            "transformers computes). This %s has bfloat16 in hardware: --dtype bfloat16 "
            "serves it faster%s, and is what vLLM's auto picks for float32 checkpoints.",
            "GPU" if device is not None and device.type == "cuda" else "CPU",
            " (1.5-1.7x the throughput on a 2-core EPYC)" if on_cpu else "",
        )
    if on_cpu and chosen != torch.float32:
        native = cpu_has_native_bf16()
        cpu_dtype = torch.bfloat16 if native else torch.float32
        if log:
            logger.info(
                "The checkpoint is %s; on this CPU (%s) serve runs it in %s. --dtype overrides.",
                dtype_name(chosen),
                "bf16 in hardware" if native else "no AVX512_BF16 or AMX",
                dtype_name(cpu_dtype),
            )
        chosen = cpu_dtype
    return chosen


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16', as the --dtype flag spells it."""
    return str(dtype).removeprefix("torch.")


def _bf16_in_hardware(device: torch.device | None) -> bool:
    if device is None:
        return False
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_native_bf16()


def model_max_len(arch: ArchConfig) -> int:
    """The longest context the weights support (sliding windows do not shorten it)."""
    return arch.max_position


def _checkpoint_files(path: Path, index_name: str, pattern: str) -> list[Path]:
    """A checkpoint's shards as its index lists them, else every file matching `pattern`."""
    index = path / index_name
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    return sorted(Path(p) for p in glob.glob(os.path.join(path, pattern)))


def _weight_files(path: Path, load_format: str, allow_pickle: bool) -> tuple[list[Path], bool]:
    """The checkpoint's weight files, and whether they are safetensors.

    Pickled `.bin` files are read with torch's restricted unpickler, but a pickle is still
    a program: they are loaded only when the user passed `--allow-pickle-weights`.
    """
    if load_format != "pt":
        safetensors = _checkpoint_files(path, "model.safetensors.index.json", "*.safetensors")
        if safetensors:
            return safetensors, True
        if load_format == "safetensors":
            raise FileNotFoundError(f"No weights (*.safetensors) found in {path}.")
    pickles = _checkpoint_files(path, "pytorch_model.bin.index.json", "*.bin")
    if not pickles:
        wanted = "*.bin" if load_format == "pt" else "*.safetensors"
        raise FileNotFoundError(f"No weights ({wanted}) found in {path}.")
    if not allow_pickle:
        raise ValueError(
            f"{path} holds only pickled .bin weights, which can run arbitrary code when "
            "loaded. Convert them to safetensors, or pass --allow-pickle-weights if you trust them."
        )
    return pickles, False


# safetensors' names for floating-point tensors, which load as the model's dtype. FP8
# tensors are an FP8 checkpoint's weights, which stay FP8 (quantization/fp8.py).
_FLOAT_CODES = {"F64", "F32", "F16", "BF16"}


def weights_bytes(path: Path, load_format: str, dtype: torch.dtype) -> int | None:
    """The checkpoint's tensors' size once loaded: floating-point ones at `dtype`'s width,
    the rest as stored. Read from the safetensors headers alone (no tensor is read); None
    for pickled checkpoints, whose sizes only unpickling would tell."""
    files, is_safetensors = _weight_files(path, load_format, allow_pickle=True)
    if not is_safetensors:
        return None
    width = dtype.itemsize
    total = 0
    for file in files:
        for name, entry in safetensors_header(file).items():
            if name == "__metadata__":
                continue
            if entry["dtype"] in _FLOAT_CODES:
                total += math.prod(entry["shape"]) * width
            else:
                start, end = entry["data_offsets"]
                total += end - start
    return total


def safetensors_header(file: Path) -> dict[str, Any]:
    """The tensor table at the start of a safetensors file; a ValueError naming the file
    for one that is not a safetensors file (a git-lfs pointer left by a clone without
    git-lfs, a download cut short)."""
    with open(file, "rb") as f:
        start = f.read(64)
        if start.startswith(b"version https://git-lfs"):
            raise ValueError(
                f"{file} is a git-lfs pointer, not the weights: fetch them (`git lfs pull` "
                "in the model's clone) or download the model again."
            )
        size = file.stat().st_size
        length = int.from_bytes(start[:8], "little") if len(start) >= 8 else None
        if length is None or length > size - 8:
            raise ValueError(
                f"{file} is not a safetensors file, or is cut short ({size} bytes); "
                "download the model again."
            )
        f.seek(8)
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError):
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"{file} has no readable safetensors header; download the model again.")
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
    ]
    if max(ends, default=0) > size - 8 - length:
        raise ValueError(f"{file} is cut short ({size} bytes); download the model again.")
    return header


def iterate_checkpoint(
    path: Path, load_format: str = "auto", *, allow_pickle: bool = False
) -> Iterator[tuple[str, LazyTensor]]:
    """Every checkpoint tensor by name, unread: a weight loader reads the part its rank
    holds (safetensors slices are read from the memory-mapped file, nothing more). Each
    tensor is valid until the iterator moves to the next file."""
    files, is_safetensors = _weight_files(path, load_format, allow_pickle)
    for file in files:
        if is_safetensors:
            from safetensors import safe_open

            safetensors_header(file)  # a clear error for a broken file, naming it
            try:
                opened = safe_open(str(file), framework="pt", device="cpu")
            except Exception as e:  # safetensors' own errors name neither file nor cause
                raise ValueError(f"{file} cannot be read as safetensors: {e}") from None
            with opened as f:
                for name in f.keys():
                    yield name, SafetensorsTensor(f, name)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
            for name, tensor in state.items():
                yield name, InMemoryTensor(tensor)


def iterate_weights(
    path: Path, load_format: str = "auto", *, allow_pickle: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor by name, read whole."""
    for name, lazy in iterate_checkpoint(path, load_format, allow_pickle=allow_pickle):
        yield name, lazy.load()


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def model_skeleton(config: ModelConfig, hf_config: Any) -> nn.Module:
    """The model's layers on the meta device, without weights: their shapes, at one rank
    (for checks that must agree with the workers' model without loading it)."""
    arch = get_arch_config(hf_config, config.model_impl)
    dtype = resolve_dtype(config.dtype, hf_config, torch.device("cpu"), log=False)
    model_class = get_model_class(getattr(hf_config, "architectures", None), config.model_impl)
    with _default_dtype(dtype), torch.device("meta"):
        return model_class(arch)


def load_model(config: ModelConfig, path: Path, hf_config: Any, device: torch.device) -> nn.Module:
    """This rank's shard of the model, on `device`. Under tensor parallelism, every rank
    calls it after `init_tensor_parallel`; each reads only its own slices."""
    arch = get_arch_config(hf_config, config.model_impl)
    check_tensor_parallel(arch, get_tp_group().world_size)
    dtype = resolve_dtype(config.dtype, hf_config, device)
    model_class = get_model_class(getattr(hf_config, "architectures", None), config.model_impl)
    with _default_dtype(dtype), torch.device(device):
        model = model_class(arch)
    weights = iterate_checkpoint(path, config.load_format, allow_pickle=config.allow_pickle_weights)
    fmt = checkpoint_format(hf_config, config.quantization)
    load_weights = getattr(model, "load_weights", None)  # a model of parts (LLaVA)
    if fmt is not None:
        names = checkpoint_names(path, config.load_format, config.allow_pickle_weights)
        if hasattr(model, "quantize_layers"):  # a model of parts quantizes its own
            layers = model.quantize_layers(fmt, names)
        elif hasattr(model, "weight_spec") and load_weights is None:
            layers = quantize_layers(model, fmt, names, model.weight_spec)
        else:
            raise ValueError(
                f"{type(model).__name__} does not read quantized checkpoints "
                f"({fmt.describe()}); serve reads them for its natively built models"
            )
        logger.info("%s: %d linear layers quantized, kept packed", fmt.describe(), len(layers))
        weights = without_dropped(weights, fmt)
    if load_weights is not None:
        load_weights(weights)
    else:
        load_checkpoint(model, weights, model.weight_spec)
    finish_quantized(model)
    if fmt is None and config.quantization == "fp8":
        count = quantize_to_fp8(model)
        logger.info("--quantization fp8: %d linear layers rounded to FP8 while loading", count)
    return model.eval()


def checkpoint_names(path: Path, load_format: str, allow_pickle: bool) -> list[str]:
    """Every checkpoint tensor's name, from the safetensors headers (nothing read)."""
    files, is_safetensors = _weight_files(path, load_format, allow_pickle)
    if not is_safetensors:
        return [name for name, _ in iterate_checkpoint(path, load_format, allow_pickle=True)]
    return [name for file in files for name in safetensors_header(file) if name != "__metadata__"]
