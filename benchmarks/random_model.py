"""A random-weight model with the default model's tokenizer, vocabulary and architecture,
resized by config overrides: performance does not depend on weight values, so benchmarks
can use shapes whose real weights are not at hand.

    python benchmarks/random_model.py --out /tmp/smollm2-small \\
        --set num_hidden_layers=2 hidden_size=128 intermediate_size=512

A small one puts a CPU in the regime of a GPU serving a real model: the forward pass takes
milliseconds, so the host's work around it (scheduling, inputs, sampling, HTTP, text)
decides the throughput. `--model-type` builds another family's layers at the default
model's widths and vocabulary (its own defaults for the rest, `--set` over both):

    python benchmarks/random_model.py --out /tmp/gemma3-smol --model-type gemma3_text \
        --set head_dim=64 query_pre_attn_scalar=64 sliding_window=512
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import transformers

from serve.models.default_model import resolve_default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# What another family's config takes from the base's (--model-type): its widths, and what
# the tokenizer and the length of the prompts depend on.
SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key, json.loads(value)


def make_config(
    base: Path, model_type: str | None, overrides: dict[str, object]
) -> transformers.PretrainedConfig:
    """`base`'s config, or `model_type`'s defaults with `base`'s SHARED_FIELDS; `overrides`
    over either (passed to another family's constructor, which derives fields such as
    Gemma's `layer_types` from them)."""
    config = transformers.AutoConfig.from_pretrained(base)
    other = model_type is not None and model_type != config.model_type
    if other:
        shared = {key: getattr(config, key) for key in SHARED_FIELDS if hasattr(config, key)}
        config = transformers.AutoConfig.for_model(model_type, **shared)
    for key in overrides:
        if not hasattr(config, key):
            raise SystemExit(f"the {config.model_type} config has no {key!r}")
    if other:
        return transformers.AutoConfig.for_model(model_type, **{**shared, **overrides})
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def build(
    out: Path,
    overrides: dict[str, object],
    seed: int,
    base: Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    model_type: str | None = None,
) -> Path:
    """Random weights in `dtype`, drawn on `device` (a GPU draws an 8B model in seconds,
    where the CPU takes minutes), saved as safetensors with `base`'s tokenizer."""
    base = resolve_default_model() if base is None else base
    config = make_config(base, model_type, overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--set", nargs="*", type=parse_override, default=[], metavar="KEY=VALUE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--base",
        type=Path,
        default=None,
        help="config and tokenizer from here; default: serve's default model",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu", help="where the weights are drawn (cpu, cuda)")
    p.add_argument(
        "--model-type",
        default=None,
        help="another family's layers at the base's widths (transformers' model_type: "
        "gemma3_text, phi3, qwen3, ...)",
    )
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    out = build(args.out, dict(args.set), args.seed, args.base, dtype, args.device, args.model_type)
    config = transformers.AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    params = sum(t.numel() for t in model.parameters())
    print(f"{out}: {params / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
