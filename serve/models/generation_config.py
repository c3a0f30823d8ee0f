"""The sampling defaults a generation config sets (Qwen's temperature 0.7, top_p 0.8, ...),
which requests that leave them out take, as vLLM's `--generation-config` and
`--override-generation-config` give them. Only the keys the file sets count:
transformers' own defaults (top_k 50) are not the model's.

Where each comes from, and what its max_new_tokens does (vLLM 0.32's rules):

    --generation-config   file read                            max_new_tokens is
    auto                  the model's generation_config.json   the default max_tokens
    vllm                  none                                 -
    DIR                   DIR/generation_config.json           the default and a cap

`--override-generation-config` is applied over what the file gives (under `vllm`, over
nothing); its own max_new_tokens caps every request's max_tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serve.config import (
    GENERATION_CONFIG_WORDS,
    generation_sampling_values,
    parse_override_generation_config,
    read_generation_config_folder,
)

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    # SamplingParams fields and values for requests that leave them out; `max_tokens`
    # the budget of a request that sets none.
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens_cap: int | None = None  # every request's budget's bound; None: none


def generation_defaults(
    model_path: str | Path,
    generation_config: str = "auto",
    override: str | dict[str, Any] | None = None,
) -> GenerationDefaults:
    """The sampling defaults and max_tokens cap that `generation_config` and `override`
    (the settings of those names) give requests."""
    given = parse_override_generation_config(override)
    if generation_config == "vllm":
        found: dict[str, Any] = {}
    elif generation_config == "auto":
        found = _model_file(Path(model_path) / FILE_NAME)
    else:
        found = read_generation_config_folder(generation_config)
    sampling = generation_sampling_values({**found, **given})
    if generation_config in GENERATION_CONFIG_WORDS:
        cap = given.get("max_new_tokens")
    else:
        cap = sampling.get("max_tokens")
    if sampling:
        logger.info(
            "Sampling defaults for requests that leave them out (--generation-config %s%s): %s",
            generation_config,
            ", --override-generation-config" if given else "",
            ", ".join(f"{k}={v}" for k, v in sampling.items()),
        )
    if cap is not None:
        logger.info("Every request's max_tokens is capped at %d (max_new_tokens)", cap)
    return GenerationDefaults(sampling, cap)


def _model_file(path: Path) -> dict[str, Any]:
    """The model's own file, where it has one; one that cannot be read is ignored, with a
    warning (a folder named by the setting is refused at start instead)."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("Ignoring %s, which cannot be read: %s", path, e)
        return {}
    return data if isinstance(data, dict) else {}
