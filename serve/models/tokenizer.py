"""Tokenizer and end-of-sequence ids for a model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from serve.models.arch_config import hf_text_config

# The files one of transformers' tokenizers loads from (fast, sentencepiece, BPE).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer in a local directory, or of an HF repo id already in the local HF
    cache. Never downloads, and never runs a checkpoint's code."""
    from transformers import AutoTokenizer

    text = str(path)
    local = Path(text).expanduser()
    if not local.exists() and (text.startswith((".", "/", "~")) or text.count("/") != 1):
        raise FileNotFoundError(
            f"Tokenizer {text!r} not found: it is not a local directory, or an HF repo id "
            "of the form 'org/name'."
        )
    if local.is_dir() and not any((local / name).exists() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{local} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); pass one "
            "with --tokenizer."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            local if local.exists() else text, trust_remote_code=False, local_files_only=True
        )
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = "" if local.exists() else " (serve does not download: is it in the local HF cache?)"
        raise ValueError(f"Cannot load a tokenizer from {text}{where}: {first_line}") from None
    if not tokenizer.chat_template and local.is_dir():
        tokenizer.chat_template = processor_chat_template(local)
    return tokenizer


def processor_chat_template(path: Path) -> str | None:
    """The chat template a multimodal checkpoint keeps for its processor rather than its
    tokenizer (`chat_template.json`, as llava-hf's repos ship it), which transformers'
    tokenizer does not read."""
    file = path / "chat_template.json"
    if not file.exists():
        return None
    try:
        template = json.loads(file.read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return template if isinstance(template, str) and template else None


def eos_token_ids(path: Path, hf_config: Any, tokenizer: Any) -> set[int]:
    """The ids that end generation, as HF `generate` sees them: generation_config.json first."""
    from transformers import GenerationConfig

    eos: Any = None
    if (path / "generation_config.json").exists():
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    if eos is None:
        eos = getattr(hf_text_config(hf_config), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
