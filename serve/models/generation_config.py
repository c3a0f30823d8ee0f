"""The sampling defaults a checkpoint's generation_config.json sets (Qwen's temperature 0.7,
top_p 0.8, ...), which vLLM's `--generation-config auto` gives every request that leaves
them out. Only the keys the file sets count: transformers' own defaults (top_k 50) are
not the model's."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json's names -> SamplingParams'.
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(model_path: Path, generation_config: str = "auto") -> dict[str, Any]:
    """SamplingParams fields and values from the model's generation_config.json, under
    `--generation-config auto`; {} under `vllm`, or where the file sets none."""
    path = Path(model_path) / "generation_config.json"
    if generation_config != "auto" or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("Ignoring %s, which cannot be read: %s", path, e)
        return {}
    defaults = {
        ours: data[theirs]
        for theirs, ours in _SAMPLING_KEYS.items()
        if isinstance(data, dict) and isinstance(data.get(theirs), (int, float))
    }
    if defaults:
        logger.info(
            "Sampling defaults from the model's generation_config.json, for requests that "
            "leave them out: %s (--generation-config vllm: serve's own)",
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
        )
    return defaults
