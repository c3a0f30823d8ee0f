"""A model's shape in one vocabulary, read once from its HF config.

HF configs spell the same numbers many ways (`n_head`, `num_attention_heads`, `n_heads`;
`n_inner`, `ffn_dim`, `intermediate_size`; Falcon's `multi_query`, GPT-BigCode's MQA,
MPT's `attn_config`). The engine needs a few of them before any weight is read (the
tensor-parallel check, the context length, the KV cache's shape), and every model class
needs them to build its layers: both read this one normalised record. Family-specific
knobs (rotary fraction, ALiBi bias, norms) stay on `hf`, the HF config itself.

Torch-free, so the engine can check a config before any worker starts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

# ALiBi and other position schemes that do not limit the context: the longest one served
# unless --max-model-len says otherwise.
UNLIMITED_POSITIONS = 1 << 20


@dataclass(frozen=True)
class ArchConfig:
    architecture: str  # the HF `architectures` entry the model class was chosen by
    hf: Any = field(repr=False, compare=False)  # the HF config, for family-specific fields
    hidden_size: int
    num_layers: int
    num_heads: int  # query heads, all ranks together
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    # The longest context the weights support: learned or rotary positions' range, or
    # UNLIMITED_POSITIONS for ALiBi.
    max_position: int
    # Sizes a tensor-parallel split must divide, by name (MLP widths, expert widths).
    split_sizes: dict[str, int] = field(default_factory=dict)
    # Per layer: the sliding window (None: full attention).
    sliding_windows: tuple[int | None, ...] = ()
    # What runs it: "native" (a serve model class) or "transformers" (transformers' modeling
    # code through serve's transformers backend, which runs at one rank).
    model_impl: str = "native"

    def __post_init__(self) -> None:
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"{len(self.sliding_windows)} sliding windows for {self.num_layers} layers"
            )

    @classmethod
    def from_hf(cls, hf: Any, architecture: str, **overrides: Any) -> ArchConfig:
        """The standard HF names (most configs map their own spellings onto them through
        `attribute_map`); a family passes what its config spells otherwise."""
        values: dict[str, Any] = {}
        hidden_size = overrides.get("hidden_size") or int(hf.hidden_size)
        num_heads = overrides.get("num_heads") or int(hf.num_attention_heads)
        values["hidden_size"] = hidden_size
        values["num_layers"] = int(hf.num_hidden_layers)
        values["num_heads"] = num_heads
        values["num_kv_heads"] = int(getattr(hf, "num_key_value_heads", None) or num_heads)
        values["head_dim"] = int(getattr(hf, "head_dim", None) or hidden_size // num_heads)
        values["vocab_size"] = int(hf.vocab_size)
        values["max_position"] = int(getattr(hf, "max_position_embeddings", None) or 2048)
        values["sliding_windows"] = hf_sliding_windows(hf, values["num_layers"])
        intermediate_size = getattr(hf, "intermediate_size", None)
        if intermediate_size is not None:
            values["split_sizes"] = {"intermediate_size": int(intermediate_size)}
        values.update(overrides)
        return cls(architecture=architecture, hf=hf, **values)


def hf_sliding_windows(hf: Any, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window as transformers applies it: `layer_types` where the config has
    them (Qwen2 past `max_window_layers`, Gemma's alternating local layers), else the one
    `sliding_window` on every layer (Mistral); None where the config turns it off."""
    window = getattr(hf, "sliding_window", None)
    if not window or not getattr(hf, "use_sliding_window", True):
        return (None,) * num_layers
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None:
        return (int(window),) * num_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def hf_text_config(hf: Any) -> Any:
    """The language model's part of a config (a vision-language model's `text_config`;
    any other config is its own)."""
    get = getattr(hf, "get_text_config", None)
    return get() if get is not None else hf


def hf_with(hf: Any, **fields: Any) -> Any:
    """A copy of the HF config with `fields` set: how a family whose config spells things its
    own way (a remote-code format read as data) hands the shared layers the names they read
    (`rms_norm_eps`, `attention_bias`, `rope_theta`, ...). The loaded config is left as it is."""
    normalised = copy.copy(hf)
    for name, value in fields.items():
        setattr(normalised, name, value)
    return normalised
