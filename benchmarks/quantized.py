"""Quantized weights against float32 on the same model, in one process: what a 4-bit,
8-bit or FP8 checkpoint buys on this machine.

The default model's decoder linears are rounded to each format's codes (round to
nearest per group: the speed of a GPTQ checkpoint, not its accuracy; RTN is what the
tests' quantizer writes, tests/quantized_models.py) and each is served offline in turn:

- batch 1: one request decoding alone, milliseconds a token (the weights read once a
  token: where fewer bytes a weight should pay);
- a burst: `--num-requests` requests at once (the workload of throughput.py), output
  tokens a second.

    python benchmarks/quantized.py
    python benchmarks/quantized.py --variants float32,gptq-4bit --num-requests 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import workload
from throughput import load_serve, machine_info, release, resolve_model_dir, run_serve
from workload import WorkloadSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from quantized_models import quantize_checkpoint  # noqa: E402

# name -> (method, options for quantize_checkpoint, engine settings); None: the float model
VARIANTS = {
    "float32": (None, {}, {}),
    "gptq-4bit": ("gptq", {"bits": 4, "group_size": 64}, {}),
    "gptq-8bit": ("gptq", {"bits": 8, "group_size": 64}, {}),
    "fp8-blocks": ("fp8", {"block": (64, 64)}, {}),
    "fp8-online": (None, {}, {"quantization": "fp8"}),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a float model directory (default: SmolLM2)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=1, help="each variant this many times")
    p.add_argument("--batch1-tokens", type=int, default=96)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache/serve/models/quantized"))
    workload.add_workload_args(p)
    p.set_defaults(num_requests=32, max_output=128)
    return p.parse_args()


def checkpoint_for(model_dir: Path, name: str, cache_dir: Path) -> tuple[Path, dict]:
    method, options, engine = VARIANTS[name]
    if method is None:
        return model_dir, engine
    target = cache_dir / model_dir.name / name
    if not (target / method / "config.json").exists():
        print(f"  quantizing {model_dir.name} as {name} ...", flush=True)
        quantize_checkpoint(model_dir, target, method, **options)
    return target / method, engine


def batch1_ms_per_token(llm, prompt: list[int], tokens: int) -> float:
    """The decode time a token of one request alone: a long run less a short one, so the
    prompt's prefill and the first token cancel out."""
    from serve import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], [params], use_tqdm=False)
        return time.perf_counter() - start

    short, long = min(run(8) for _ in range(2)), min(run(8 + tokens) for _ in range(2))
    return 1000 * (long - short) / tokens


def main() -> None:
    from serve import SamplingParams
    from serve.models.loader import weights_bytes

    args = parse_args()
    model_dir = resolve_model_dir(args.model)
    tokenizer_ids = workload.ordinary_token_ids(_tokenizer(model_dir))
    requests = workload.make_requests(WorkloadSpec.from_args(args), tokenizer_ids)
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.num_output_tokens, ignore_eos=True)
        for r in requests
    ]
    names = args.variants.split(",")
    checkpoints = {n: checkpoint_for(model_dir, n, Path(args.cache_dir)) for n in names}
    results: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for round_ in range(args.rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            path, engine = checkpoints[name]
            llm = load_serve(str(path), "float32", requests, **engine)
            ms = batch1_ms_per_token(llm, requests[0].prompt_token_ids[:32], args.batch1_tokens)
            burst = run_serve(llm, requests, params, name)
            release(llm)
            results[name].append((ms, burst.output_tokens_per_s))
            print(
                f"  round {round_ + 1} {name}: batch 1 {ms:.1f} ms/token, burst "
                f"{burst.output_tokens_per_s:.1f} tok/s",
                flush=True,
            )
    print(f"\n{machine_info()}")
    print(
        f"burst: {len(requests)} requests, {sum(r.num_output_tokens for r in requests)} "
        "output tokens; medians over rounds\n"
    )
    base_ms, base_tps = (statistics.median(v) for v in zip(*results[names[0]]))
    print(
        f"| variant | weights MB | batch 1 ms/token | vs {names[0]} | burst tok/s | vs {names[0]} |"
    )
    print("|---|---|---|---|---|---|")
    for name in names:
        ms, tps = (statistics.median(v) for v in zip(*results[name]))
        path, engine = checkpoints[name]
        size = weights_bytes(path, "auto", _float32())
        if engine.get("quantization") == "fp8":
            size = None
        mb = "—" if size is None else f"{size / 2**20:.0f}"
        print(
            f"| {name} | {mb} | {ms:.1f} | {base_ms / ms:.2f}x | {tps:.1f} | {tps / base_tps:.2f}x |"
        )


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _float32():
    import torch

    return torch.float32


if __name__ == "__main__":
    main()
