"""A model's pooling defaults, read once at start from its directory (as data, no code).

Precedence, as vLLM's: the flags (`--pooling-type`, `--[no-]pooling-normalize`), then a
sentence-transformers config, then last-token pooling, L2-normalised (vLLM's default for
decoder embedding models).

A sentence-transformers model lists its modules in `modules.json`; its `Pooling` module's
`config.json` (usually `1_Pooling/config.json`) names the mode (`pooling_mode_lasttoken`,
`pooling_mode_mean_tokens`, `pooling_mode_cls_token`) and a `Normalize` module means the
vectors are L2-normalised. Modes serve cannot reproduce (max, weighted mean, mean over
sqrt(len)) and modules it does not run (a `Dense` projection) are logged, and the default
stands: the embeddings then differ from sentence-transformers'.

`dimensions` (Matryoshka truncation) is allowed where the HF config says the model was
trained for it: `is_matryoshka`, or `matryoshka_dimensions` listing the sizes (vLLM's rule).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from serve.pooling_params import ModelPooling

logger = logging.getLogger(__name__)

DEFAULT_POOLING_TYPE = "last"
# sentence-transformers' Pooling config keys -> serve's pooling types.
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_MODULES = "sentence_transformers.models."


def model_pooling(
    model_path: Path,
    hf_config: Any,
    hidden_size: int,
    pooling_type: str | None = None,
    normalize: bool | None = None,
) -> ModelPooling:
    """The model's pooling defaults: the flags' values where set, else its
    sentence-transformers config's, else last and normalised."""
    st_type, st_normalize = _sentence_transformers_pooling(Path(model_path))
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return ModelPooling(
        pooling_type=pooling_type or st_type or DEFAULT_POOLING_TYPE,
        normalize=next(v for v in (normalize, st_normalize, True) if v is not None),
        hidden_size=hidden_size,
        is_matryoshka=bool(getattr(hf_config, "is_matryoshka", False)),
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
    )


def _sentence_transformers_pooling(model_path: Path) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) from a sentence-transformers config; (None, None) when
    the directory has none (or one serve cannot read, which is logged)."""
    modules_file = model_path / "modules.json"
    if not modules_file.is_file():
        return None, None
    try:
        modules = json.loads(modules_file.read_text())
        types = [str(m.get("type", "")) for m in modules]
        pooling = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
        config = {}
        if pooling is not None:
            config = json.loads((model_path / str(pooling["path"]) / "config.json").read_text())
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        logger.warning("Cannot read the sentence-transformers config in %s (%s)", model_path, e)
        return None, None
    unused = [t for t in types if not t.endswith(("Transformer", "Pooling", "Normalize"))]
    if unused:
        logger.warning(
            "The sentence-transformers modules %s are not run by serve: embeddings are the "
            "pooled hidden states without them.",
            ", ".join(t.removeprefix(_ST_MODULES) for t in unused),
        )
    normalize = any(t.endswith("Normalize") for t in types)
    mode = next((kind for key, kind in _ST_MODES.items() if config.get(key) is True), None)
    if pooling is not None and mode is None:
        named = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v is True)
        logger.warning(
            "The sentence-transformers pooling mode %s is not supported (last, mean, cls); "
            "pooling by %s.",
            ", ".join(named) or "(none)",
            DEFAULT_POOLING_TYPE,
        )
    if config.get("include_prompt") is False:
        logger.warning(
            "The sentence-transformers pooling excludes the prompt (include_prompt false); "
            "serve pools every prompt token."
        )
    return mode, normalize
