"""Generation throughput per model family: serve against HF transformers, side by side.

Each family of tests/model_families.py is built at a small-but-not-trivial size (hidden
512, 4 layers, 8 heads; the family's own fields kept) with random weights, then both
engines generate the same greedy continuations in one process: HF with one static batch
(`generate`, KV cache on, every prompt the same length so nothing is padded), serve with
`LLM.generate`. Both compute the same tokens; the ratio is serve's tokens/s over HF's.

    python benchmarks/families.py                       # every family
    python benchmarks/families.py --families gpt2,bloom --num-prompts 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from model_families import FAMILIES, FAMILIES_BY_KEY  # noqa: E402
from tiny_models import make_tiny_model, random_prompts  # noqa: E402

# The benchmark size, over the tiny test shape; a family's own fields stay unless named here.
SIZE = {
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 1408,
    "max_position_embeddings": 1024,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=None, help="comma-separated keys; default: all")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up; the best counts")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


def _size_for(family) -> dict:
    """SIZE, minus what the family's config spells itself (its head layout, its widths)."""
    size = {k: v for k, v in SIZE.items() if k not in family.config and k not in family.drop}
    if family.config.get("num_key_value_heads") == 1 or "multi_query" in family.config:
        size.pop("num_key_value_heads", None)
    return size


def _time_best(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations, lazy imports
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_family(key: str, args: argparse.Namespace, work_dir: Path) -> dict:
    import transformers

    from serve import LLM, SamplingParams

    family = FAMILIES_BY_KEY[key]
    model_dir = make_tiny_model(key, work_dir / key, **_size_for(family))
    prompts = random_prompts(512, args.num_prompts, args.prompt_len, args.prompt_len, seed=0)
    num_tokens = args.num_prompts * args.output_len

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids = torch.tensor(prompts)

    def run_hf() -> None:
        with torch.no_grad():
            out = hf.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=args.output_len,
                eos_token_id=[],  # never stops early, and no logits processor is added
                pad_token_id=hf.config.pad_token_id,
            )
        assert out.shape[1] == args.prompt_len + args.output_len

    hf_s = _time_best(run_hf, args.repeats)

    llm = LLM(model=str(model_dir), kv_cache_memory="512MiB", enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]

    def run_serve() -> None:
        outs = llm.generate(requests, params, use_tqdm=False)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == num_tokens

    serve_s = _time_best(run_serve, args.repeats)
    return {
        "family": key,
        "architecture": family.architecture,
        "hf_tokens_per_s": num_tokens / hf_s,
        "serve_tokens_per_s": num_tokens / serve_s,
        "ratio": hf_s / serve_s,
    }


def main() -> None:
    args = parse_args()
    keys = args.families.split(",") if args.families else [f.key for f in FAMILIES]
    unknown = sorted(set(keys) - set(FAMILIES_BY_KEY))
    if unknown:
        raise SystemExit(f"unknown families: {unknown}; known: {sorted(FAMILIES_BY_KEY)}")
    print(
        f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; {args.num_prompts} prompts x {args.prompt_len} tokens, "
        f"{args.output_len} out, float32, best of {args.repeats} after a warm-up",
        flush=True,
    )
    print(f"{'family':<18} {'architecture':<28} {'HF tok/s':>9} {'serve tok/s':>12} {'ratio':>6}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for key in keys:
            r = bench_family(key, args, Path(tmp))
            results.append(r)
            print(
                f"{r['family']:<18} {r['architecture']:<28} {r['hf_tokens_per_s']:>9.1f} "
                f"{r['serve_tokens_per_s']:>12.1f} {r['ratio']:>5.2f}x",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
