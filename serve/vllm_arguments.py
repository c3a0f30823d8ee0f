"""vLLM's engine arguments that serve has no setting of its own for: taken by `LLM(...)`
and as flags (`serve --help` lists them in a group of their own), so that vLLM scripts and
command lines run unchanged. Each maps its value onto serve's settings, or is refused by
name where serve cannot honour it (never ignored where it would change an output)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serve.config import InvalidSettingError


@dataclass(frozen=True)
class VllmArgument:
    """A vLLM engine argument that serve has no setting of its own for, taken by `LLM(...)`
    and as a flag so that vLLM scripts and command lines run unchanged. `apply` maps its
    value onto serve's settings ({}: nothing to change), or raises InvalidSettingError for
    a value serve cannot honour. `kind` is bool (a switch) or str."""

    name: str
    kind: type
    help: str
    apply: Callable[[Any], dict[str, Any]]

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


def _ignored(value: Any) -> dict[str, Any]:
    return {}


def _only(name: str, accepted: tuple[Any, ...], why: str) -> Callable[[Any], dict[str, Any]]:
    def apply(value: Any) -> dict[str, Any]:
        if value not in accepted:
            raise InvalidSettingError(name, f"{why}; got {value!r}.")
        return {}

    return apply


_XGRAMMAR_BACKENDS = (None, "auto", "xgrammar")
_XGRAMMAR_ONLY = "must be xgrammar or auto: serve constrains output with xgrammar alone"


def _structured_outputs_config(value: Any) -> dict[str, Any]:
    """vLLM's `--structured-outputs-config '{"backend": "xgrammar"}'` (a dict to `LLM`)."""
    if value is None:
        return {}
    config = value
    if isinstance(value, str):
        try:
            config = json.loads(value)
        except json.JSONDecodeError:
            config = None
    if not isinstance(config, dict):
        raise InvalidSettingError(
            "structured_outputs_config",
            f'must be a JSON object such as {{"backend": "xgrammar"}}; got {value!r}.',
        )
    # serve writes JSON without extra whitespace, so that switch asks for what it does.
    others = sorted(
        set(config)
        - {"backend"}
        - ({"disable_any_whitespace"} if config.get("disable_any_whitespace") else set())
    )
    if others:
        raise InvalidSettingError(
            "structured_outputs_config",
            f"takes only backend (and disable_any_whitespace true, as serve writes JSON) "
            f"here: serve has no setting for {', '.join(others)}.",
        )
    return _only("structured_outputs_config", _XGRAMMAR_BACKENDS, _XGRAMMAR_ONLY)(
        config.get("backend")
    )


def _json_value(name: str, value: Any) -> Any:
    """A flag's JSON text as its value (an `LLM(...)` keyword comes as the object)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise InvalidSettingError(name, f"must be JSON; got {value!r}.") from None


def _number(name: str, value: Any) -> float:
    """A flag's number (text on the command line), or a refusal naming it."""
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise InvalidSettingError(name, f"must be a number; got {value!r}.") from None


def _cpu_offload_gb(value: Any) -> dict[str, Any]:
    if value is not None and _number("cpu_offload_gb", value) != 0:
        raise InvalidSettingError(
            "cpu_offload_gb",
            f"must be 0: serve keeps all the weights on the device that runs them (no CPU "
            f"offload); got {value!r}.",
        )
    return {}


def _max_seq_len_to_capture(value: Any) -> dict[str, Any]:
    if value is not None:
        number = _number("max_seq_len_to_capture", value)
        if number < 1 or number != int(number):
            raise InvalidSettingError(
                "max_seq_len_to_capture", f"must be a positive integer; got {value!r}."
            )
    return {}


_COMPILATION_KEYS = ("level", "mode", "cudagraph_mode")
_COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")


def _compilation_config(value: Any) -> dict[str, Any]:
    """vLLM's `compilation_config`: a level (0-3), or {"level"/"mode": ..., "cudagraph_mode":
    ...} as a dict or JSON. serve compiles nothing with torch.compile, so a level or mode
    changes nothing; cudagraph_mode NONE is --no-cuda-graphs, any other serve's own graphs."""
    name = "compilation_config"
    if value is None:
        return {}
    config = _json_value(name, value)
    if isinstance(config, int) and not isinstance(config, bool):
        config = {"level": config}
    if not isinstance(config, dict):
        raise InvalidSettingError(
            name, f'must be a level (0-3) or a JSON object such as {{"level": 0}}; got {value!r}.'
        )
    others = sorted(set(config) - set(_COMPILATION_KEYS))
    if others:
        raise InvalidSettingError(
            name,
            f"takes only {', '.join(_COMPILATION_KEYS)} here: serve has no setting for "
            f"{', '.join(others)}.",
        )
    for key in ("level", "mode"):
        level = config.get(key)
        level = getattr(level, "value", level)  # vLLM's CompilationMode
        if level is not None and level not in (0, 1, 2, 3, *_COMPILATION_MODES):
            raise InvalidSettingError(
                name, f"{key} must be 0-3 or one of {', '.join(_COMPILATION_MODES)}; got {level!r}."
            )
    mode = config.get("cudagraph_mode")
    mode_name = getattr(mode, "name", mode)  # vLLM's CUDAGraphMode, or its name
    if isinstance(mode_name, str) and mode_name.upper() == "NONE":
        return {"cuda_graphs": False}
    return {}


def _refused_unless_empty(name: str, why: str) -> Callable[[Any], dict[str, Any]]:
    def apply(value: Any) -> dict[str, Any]:
        if value is not None and _json_value(name, value) not in ({}, None):
            raise InvalidSettingError(name, f"{why}; got {value!r}.")
        return {}

    return apply


# What serve's LLM does with any model: generate (LLM.generate, /v1/completions) and embed
# (LLM.embed, /v1/embeddings). vLLM's runners, conversions and (older) tasks that mean
# those are accepted.
_GENERATE_AND_EMBED = "serve's LLM generates and embeds (LLM.embed) with any model"

VLLM_ARGUMENTS = (
    VllmArgument(
        "enforce_eager",
        bool,
        "vLLM's name for --no-cuda-graphs",
        lambda eager: {"cuda_graphs": False} if eager else {},
    ),
    VllmArgument(
        "trust_remote_code",
        bool,
        "accepted so vLLM command lines run: serve runs no code from a checkpoint, only the "
        "architectures it knows (see --model-impl)",
        _ignored,
    ),
    VllmArgument(
        "disable_log_stats",
        bool,
        "vLLM's name for --no-log-stats",
        lambda disable: {"log_stats": False} if disable else {},
    ),
    VllmArgument(
        "tokenizer_mode",
        str,
        "auto only: the model's HF tokenizer, as vLLM's auto mode loads it",
        _only("tokenizer_mode", (None, "auto", "hf"), "must be auto (serve has no other mode)"),
    ),
    VllmArgument(
        "revision",
        str,
        "accepted when unset: serve loads the model as it is on disk or in the local HF cache",
        _only("revision", (None,), "cannot be chosen: serve loads the model as it is on disk"),
    ),
    VllmArgument(
        "pipeline_parallel_size",
        str,
        "accepted when 1: serve splits a model across devices by tensor parallelism only",
        _only(
            "pipeline_parallel_size",
            (None, 1, "1"),
            "must be 1: serve has no pipeline parallelism; use --tensor-parallel-size",
        ),
    ),
    VllmArgument(
        "structured_outputs_config",
        str,
        'vLLM\'s JSON form, accepted with {"backend": "xgrammar"} or "auto": serve\'s '
        "structured output is xgrammar's",
        _structured_outputs_config,
    ),
    VllmArgument(  # vLLM's dotted form of a config's field; a flag only
        "structured_outputs_config.backend",
        str,
        "accepted when xgrammar or auto: serve's structured output is xgrammar's",
        _only("structured_outputs_config.backend", _XGRAMMAR_BACKENDS, _XGRAMMAR_ONLY),
    ),
    VllmArgument(
        "runner",
        str,
        "auto, generate or pooling: serve generates and embeds with any model",
        _only(
            "runner",
            (None, "auto", "generate", "pooling"),
            f"must be auto, generate or pooling: {_GENERATE_AND_EMBED}, and has no draft runner",
        ),
    ),
    VllmArgument(
        "convert",
        str,
        "auto, none or embed: serve embeds with any model (no classify or reward heads)",
        _only(
            "convert",
            (None, "auto", "none", "embed"),
            f"must be auto, none or embed: {_GENERATE_AND_EMBED}, and has no classify or "
            "reward heads",
        ),
    ),
    VllmArgument(
        "lora_dtype",
        str,
        "auto only: serve keeps LoRA adapters in the model's dtype",
        _only("lora_dtype", (None, "auto"), "must be auto: adapters run in the model's dtype"),
    ),
    VllmArgument(
        "fully_sharded_loras",
        bool,
        "accepted so vLLM command lines run: under tensor parallelism serve splits each "
        "adapter as the layer it adapts is split (B's rows for a column-parallel layer, A's "
        "columns for a row-parallel one)",
        _ignored,
    ),
    VllmArgument(  # older vLLM's
        "task",
        str,
        "auto, generate, embed or embedding: serve generates and embeds with any model",
        _only(
            "task",
            (None, "auto", "generate", "embed", "embedding"),
            f"must be auto, generate or embed: {_GENERATE_AND_EMBED}; it cannot classify, "
            "score, reward or transcribe",
        ),
    ),
    VllmArgument(
        "download_dir",
        str,
        "refused: serve never downloads; it loads a local directory or a repo already in the "
        "HF cache (HF_HUB_CACHE)",
        _only(
            "download_dir",
            (None,),
            "cannot be set: serve never downloads, and looks a repo id up in the HF cache "
            "alone. For a model vLLM downloaded there, set HF_HUB_CACHE to that directory "
            "(the same layout), or pass the model's snapshot directory as model",
        ),
    ),
    VllmArgument(
        "cpu_offload_gb",
        str,
        "accepted when 0: serve keeps all the weights on the device that runs them",
        _cpu_offload_gb,
    ),
    VllmArgument(  # older vLLM's
        "max_seq_len_to_capture",
        str,
        "accepted, no effect: serve's CUDA graphs replay decode steps at every context length",
        _max_seq_len_to_capture,
    ),
    VllmArgument(
        "disable_custom_all_reduce",
        bool,
        "accepted, no effect: tensor-parallel all-reduces are torch.distributed's (NCCL on "
        "CUDA, gloo on CPU); serve has no custom all-reduce",
        _ignored,
    ),
    VllmArgument(
        "compilation_config",
        str,
        "a level (0-3) or JSON with level, mode, cudagraph_mode: serve runs no torch.compile "
        '(a level changes nothing); {"cudagraph_mode": "NONE"} is --no-cuda-graphs',
        _compilation_config,
    ),
    VllmArgument(
        "language_model_only",
        bool,
        "refuse images, as --limit-mm-per-prompt '{\"image\": 0}' (serve still loads the "
        "vision tower)",
        lambda on: {"limit_mm_per_prompt": {"image": 0}} if on else {},
    ),
    VllmArgument(
        "hf_overrides",
        str,
        "accepted when empty: serve reads the model's config.json as it is",
        _refused_unless_empty(
            "hf_overrides",
            "is not supported: serve reads the model's config.json as it is; edit the "
            "config.json of a copy of the model directory instead",
        ),
    ),
)
