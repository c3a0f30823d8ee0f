"""A random-weight model with the default model's tokenizer, vocabulary and architecture,
resized by config overrides: performance does not depend on weight values, so benchmarks
can use shapes whose real weights are not at hand.

    python benchmarks/random_model.py --out /tmp/smollm2-small \\
        --set num_hidden_layers=2 hidden_size=128 intermediate_size=512

A small one puts a CPU in the regime of a GPU serving a real model: the forward pass takes
milliseconds, so the host's work around it (scheduling, inputs, sampling, HTTP, text)
decides the throughput.
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


def parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key, json.loads(value)


def build(out: Path, overrides: dict[str, object], seed: int) -> Path:
    base = resolve_default_model()
    config = transformers.AutoConfig.from_pretrained(base)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise SystemExit(f"the default model's config has no {key!r}")
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
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
    args = p.parse_args()
    out = build(args.out, dict(args.set), args.seed)
    params = sum(
        t.numel() for t in transformers.AutoModelForCausalLM.from_pretrained(out).parameters()
    )
    print(f"{out}: {params / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
