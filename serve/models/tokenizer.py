"""Tokenizer and end-of-sequence ids for a model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:
        raise ValueError(f"Cannot load a tokenizer from {path}: {e}") from None


def eos_token_ids(path: Path, hf_config: Any, tokenizer: Any) -> set[int]:
    """The ids that end generation, as HF `generate` sees them: generation_config.json first."""
    from transformers import GenerationConfig

    eos: Any = None
    if (path / "generation_config.json").exists():
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
