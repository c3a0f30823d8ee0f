"""Write a draft model for speculative decoding from an HF model directory: its first N
decoder layers, with its embeddings, final norm and head (tied or not), and its
tokenizer; config.json says num_hidden_layers=N. The draft shares the target's vocabulary
by construction, and its layers are the target's own, so it guesses better than a random
model of its size (how much better is what benchmarks/spec_decode.py measures).

    python benchmarks/make_draft.py --num-layers 8 --out /tmp/smollm2-draft-8
    serve --speculative-config '{"method": "draft_model", "model": "/tmp/smollm2-draft-8",
                                 "num_speculative_tokens": 4}'

--model defaults to the default model (SmolLM2-135M-Instruct's GGUF, converted once to a
safetensors directory by serve/models/default_model.py); a .gguf file or a directory
holding one is converted the same way.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import save_file

from serve.models.loader import iterate_weights, resolve_model_path

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Per-layer lists some configs carry (their length is the layer count).
_PER_LAYER_KEYS = ("layer_types", "sliding_window_pattern_layers", "no_rope_layers")


def make_draft(model: str | None, num_layers: int, out_dir: Path) -> Path:
    """The draft of `model`'s first `num_layers` layers, written to `out_dir`."""
    source = resolve_model_path(model)
    config = json.loads((source / "config.json").read_text())
    total = config.get("num_hidden_layers")
    if total is None:
        raise ValueError(f"{source}/config.json has no num_hidden_layers.")
    if not 1 <= num_layers < total:
        raise ValueError(f"--num-layers must be from 1 to {total - 1} (the model has {total}).")
    config["num_hidden_layers"] = num_layers
    for key in _PER_LAYER_KEYS:
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]

    tensors = {}
    for name, tensor in iterate_weights(source):
        layer = _LAYER.search(name)
        if layer is None or int(layer.group(1)) < num_layers:
            tensors[name] = tensor.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in source.iterdir():  # tokenizer and generation config
        if file.is_file() and file.name != "config.json" and not _is_weights(file.name):
            shutil.copy2(file, out_dir / file.name)
    return out_dir


def _is_weights(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".gguf", ".index.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="HF model directory or .gguf (default: the default model)"
    )
    parser.add_argument(
        "--num-layers", type=int, required=True, help="decoder layers the draft keeps"
    )
    parser.add_argument("--out", type=Path, required=True, help="directory to write the draft to")
    args = parser.parse_args()
    out = make_draft(args.model, args.num_layers, args.out)
    print(f"draft with {args.num_layers} layers written to {out}")


if __name__ == "__main__":
    main()
