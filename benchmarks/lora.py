"""What LoRA adapters cost: the same offline workload on the base model and with adapters,
side by side in one run (offline `LLM`, the default model unless `--model`).

Engines, each loaded once and run in turns (ABCD, then DCBA, ...) so that a slow moment of
the machine hits every one:
  base        LoRA off;
  lora-off    --enable-lora, every request on the base model (the slots' cost alone);
  one         every request with one adapter;
  four        the requests spread over four adapters (max_loras 4), in the same steps.

The adapters are random rank-`--rank` PEFT folders on all seven projections of every layer
(q, k, v, o, gate, up, down), written to a temporary folder. Reported: output tokens per
second for a burst of `--requests` at once, and at batch 1 (one request alone).

    python benchmarks/lora.py
    python benchmarks/lora.py --rounds 3 --rank 8
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import save_file

from serve import LLM, LoRARequest, SamplingParams
from serve.models.default_model import resolve_default_model

PROJECTIONS = {
    "self_attn.q_proj": ("hidden", "q"),
    "self_attn.k_proj": ("hidden", "kv"),
    "self_attn.v_proj": ("hidden", "kv"),
    "self_attn.o_proj": ("q", "hidden"),
    "mlp.gate_proj": ("hidden", "inter"),
    "mlp.up_proj": ("hidden", "inter"),
    "mlp.down_proj": ("inter", "hidden"),
}


def write_adapter(model: Path, out: Path, rank: int, seed: int) -> Path:
    """A random LoRA adapter (A and B both nonzero) for a Llama-shaped model."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    sizes = {
        "hidden": config["hidden_size"],
        "q": config["num_attention_heads"] * head_dim,
        "kv": config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim,
        "inter": config["intermediate_size"],
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in PROJECTIONS.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            a = torch.randn(rank, sizes[fan_in], generator=generator) * 0.01
            b = torch.randn(sizes[fan_out], rank, generator=generator) * 0.01
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
    out.mkdir(parents=True, exist_ok=True)
    targets = [name.split(".")[-1] for name in PROJECTIONS]
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    adapter_config |= {"target_modules": targets, "bias": "none", "task_type": "CAUSAL_LM"}
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Llama-shaped model folder")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    model = Path(args.model) if args.model else resolve_default_model()
    rng = random.Random(0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(64, 256))] for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    folder = Path(tempfile.mkdtemp(prefix="serve-lora-bench-"))
    adapters = [
        LoRARequest(f"adapter-{i}", i + 1, str(write_adapter(model, folder / str(i), args.rank, i)))
        for i in range(4)
    ]
    common = {"dtype": args.dtype, "kv_cache_memory": "2GiB", "enable_prefix_caching": False}
    setups = {
        "base": ({}, [None]),
        "lora-off": ({"enable_lora": True, "max_lora_rank": args.rank}, [None]),
        "one": ({"enable_lora": True, "max_lora_rank": args.rank}, adapters[:1]),
        "four": ({"enable_lora": True, "max_lora_rank": args.rank, "max_loras": 4}, adapters),
    }
    engines = {}
    for name, (settings, _) in setups.items():
        engines[name] = LLM(str(model), **common, **settings)
    burst: dict[str, list[float]] = {name: [] for name in setups}
    single: dict[str, list[float]] = {name: [] for name in setups}
    order = list(setups)
    for round_index in range(args.rounds):
        for name in order if round_index % 2 == 0 else order[::-1]:
            llm, (_, loras) = engines[name], setups[name]
            chosen = [loras[i % len(loras)] for i in range(len(prompts))]
            inputs = [{"prompt_token_ids": p} for p in prompts]
            llm.generate(inputs[:2], params, use_tqdm=False, lora_request=chosen[:2])  # warm
            start = time.perf_counter()
            llm.generate(inputs, params, use_tqdm=False, lora_request=chosen)
            burst[name].append(len(prompts) * args.output_len / (time.perf_counter() - start))
            start = time.perf_counter()
            llm.generate(inputs[:1], params, use_tqdm=False, lora_request=chosen[0])
            single[name].append(args.output_len / (time.perf_counter() - start))
            print(
                f"round {round_index + 1} {name}: {burst[name][-1]:.1f} tok/s burst, "
                f"{single[name][-1]:.1f} tok/s alone",
                flush=True,
            )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(
        f"\n{datetime.now(timezone.utc):%Y-%m-%d}, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, commit {commit}, {args.dtype}, {args.requests} requests x "
        f"{args.output_len} tokens, rank {args.rank}, {args.rounds} rounds (median)\n"
    )
    print("| engine | burst tok/s | vs base | alone tok/s | vs base |")
    print("|---|---|---|---|---|")
    base_burst, base_single = statistics.median(burst["base"]), statistics.median(single["base"])
    for name in setups:
        b, s = statistics.median(burst[name]), statistics.median(single[name])
        print(f"| {name} | {b:.1f} | {b / base_burst:.2f}x | {s:.1f} | {s / base_single:.2f}x |")


if __name__ == "__main__":
    main()
