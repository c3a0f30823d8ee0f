"""GET /tokenizer_info: the tokenizer's configuration, as vLLM serves it.

Clients that tokenize on the server's side read it together with `/tokenize` and
`/detokenize` (lm-evaluation-harness' `tokenizer_backend=remote` reads `eos_token`,
`bos_token`, `pad_token` and `chat_template`, which it renders with jinja2 itself). The
body is the tokenizer's `tokenizer_config.json` as loaded (`init_kwargs`), special tokens
as their text, plus `tokenizer_class` and the chat template this server renders with
(`--chat-template`, else the tokenizer's). Nothing of this machine's filesystem is shown:
file fields go, and `name_or_path` is the served model name, as on the model card.
"""

from __future__ import annotations

import math
from typing import Any

# Where the tokenizer was loaded from on this machine: not the client's business.
_LOCAL_FIELDS = frozenset({"name_or_path", "is_local", "local_files_only", "_commit_hash"})
_LOCAL_SUFFIXES = ("_file", "_files", "_dir")


def tokenizer_info(tokenizer: Any, chat_template: str | None, model_name: str) -> dict[str, Any]:
    """The JSON body of /tokenizer_info for `tokenizer`, served as `model_name`."""
    init_kwargs = getattr(tokenizer, "init_kwargs", None) or {}
    info = {
        key: _plain(value)
        for key, value in init_kwargs.items()
        if key not in _LOCAL_FIELDS and not key.endswith(_LOCAL_SUFFIXES)
    }
    # The special tokens as the tokenizer resolved them (a config may leave some out).
    info.update(tokenizer.special_tokens_map)
    info["model_max_length"] = tokenizer.model_max_length
    info["tokenizer_class"] = type(tokenizer).__name__
    info["name_or_path"] = model_name
    template = _default_template(tokenizer, chat_template)
    if template is not None:
        info["chat_template"] = template
    else:
        info.pop("chat_template", None)
    return info


def _default_template(tokenizer: Any, chat_template: str | None) -> str | None:
    """The template a request without tools renders with; None if there is none."""
    if chat_template is not None:
        return chat_template
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return tokenizer.get_chat_template()
    except ValueError:  # named templates, none of them "default"
        return None


def _plain(value: Any) -> Any:
    """`value` as JSON: added tokens as their text, mapping keys as strings."""
    if hasattr(value, "content"):  # tokenizers' AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no infinity
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
