"""Linears on the native panels against oneDNN, on compare_peers' burst offline.

One `LLM` (the default model in `--dtype`, float32 by default, prefix caching off, a 4 GiB
cache), every linear's weight packed both ways up front (the panels
`serve.kernels.cpu.packed_weight` makes, and oneDNN's reorder that it made before them), the burst of 64 requests (prompts 32-512
tokens, outputs 16-256, greedy with `ignore_eos`) run `--rounds` times on each in ABBA
order: the two sides share the process, the weights and the host's phase. Also times
`--decode-steps` decode steps of `--batch` sequences alone, the sides alternating step by
step. Prints each run, the medians' ratio, and how many requests gave the same tokens on
both sides (the two sum in different orders, so a near-tie may break differently).

    python benchmarks/packed_linears.py --rounds 2

`--linears 3,16,64,512` times the linears alone instead, no engine: the default model's
four decoder shapes (each shape's 30 weights cycled from memory, as a step reads them) and
its lm_head (two weights), oneDNN against the panels at each row count, alternated seven
times, each side's output buffers reused as the engine's heap reuses them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import offline_ab
import torch
import workload

from serve import LLM, SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: serve's default model")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=2, help="burst runs of each side")
    p.add_argument("--batch", type=int, default=64, help="sequences in the decode steps")
    p.add_argument("--context", type=int, default=350, help="their prompt tokens")
    p.add_argument("--decode-steps", type=int, default=40, help="0: no decode steps")
    p.add_argument("--linears", default=None, help="row counts: time the linears alone")
    workload.add_workload_args(p)
    return p.parse_args()


def linear_weights(llm: LLM) -> list[torch.Tensor]:
    model = llm.engine.executor.worker.model_runner.model
    weights = [getattr(m, "weight", None) for m in model.modules()]
    return [w for w in weights if isinstance(w, torch.Tensor) and hasattr(w, "_serve_packed")]


def decode_steps(llm: LLM, args: argparse.Namespace, use: dict) -> dict[str, list[float]]:
    """Per-step wall ms of `args.batch` sequences decoding together, the sides alternating."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 8, ignore_eos=True)
    for i in range(args.batch):
        prompt = [rng.randrange(1000, 40000) for _ in range(args.context)]
        llm.add_request(f"decode-{i}", prompt, params)
    started = 0
    while started < args.batch:  # until every prompt is in and each has decoded a token
        started = sum(1 for out in llm.step() if out.outputs[0].token_ids)
    times: dict[str, list[float]] = {"onednn": [], "panels": []}
    for step in range(args.decode_steps):
        side = ("onednn", "panels")[step % 2]
        use[side]()
        start = time.perf_counter()
        llm.step()
        times[side].append((time.perf_counter() - start) * 1e3)
    while llm.has_unfinished_requests():
        llm.step()
    return times


# The default model's linears: (out_features, in_features), and how many weights a step reads.
SHAPES = {
    "qkv": ((960, 576), 30),
    "o": ((576, 576), 30),
    "gate_up": ((3072, 576), 30),
    "down": ((576, 1536), 30),
    "lm_head": ((49152, 576), 2),
}


def time_linears(row_counts: list[int], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = {
        name: [(torch.randn(shape, generator=gen) * 0.05).to(dtype) for _ in range(count)]
        for name, (shape, count) in SHAPES.items()
    }
    onednn = {
        name: [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
        for name, ws in weights.items()
    }
    panels = {
        name: [torch.ops.serve_cpu.pack_panels(w) for w in ws] for name, ws in weights.items()
    }

    def run(side: str, name: str, x: torch.Tensor, out: torch.Tensor) -> None:
        for packed in (onednn if side == "onednn" else panels)[name]:
            if side == "onednn":
                torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            else:
                torch.ops.serve_cpu.linear_panels(out, x, packed, None)

    print("rows  linear     oneDNN GFLOP/s  panels GFLOP/s  ratio")
    for rows in row_counts:
        totals = {"onednn": 0.0, "panels": 0.0}
        flops_total = 0
        for name, ((n, k), count) in SHAPES.items():
            x = torch.randn(rows, k, generator=gen).to(dtype)
            out = torch.empty(rows, n, dtype=dtype)
            times: dict[str, list[float]] = {"onednn": [], "panels": []}
            for rep in range(7):
                for side in ("onednn", "panels") if rep % 2 else ("panels", "onednn"):
                    start = time.perf_counter()
                    run(side, name, x, out)
                    times[side].append((time.perf_counter() - start) / count)
            flops = 2 * rows * n * k
            a, b = (statistics.median(times[side]) for side in ("onednn", "panels"))
            print(
                f"{rows:4d}  {name:9s} {flops / a / 1e9:9.0f} {flops / b / 1e9:15.0f} {a / b:8.2f}x"
            )
            if name != "lm_head":
                totals["onednn"] += a
                totals["panels"] += b
                flops_total += flops
        a, b = totals["onednn"], totals["panels"]
        print(
            f"{rows:4d}  a layer   {flops_total / a / 1e9:9.0f} {flops_total / b / 1e9:15.0f} "
            f"{a / b:8.2f}x  ({a * 1e6:.0f} against {b * 1e6:.0f} us)",
            flush=True,
        )


def main() -> None:
    args = parse_args()
    if args.linears:
        from serve.kernels import cpu

        dtype = getattr(torch, args.dtype)
        if not cpu.panels_fit(dtype):
            raise SystemExit(f"the native panels take no {args.dtype} here")
        time_linears([int(r) for r in args.linears.split(",")], dtype)
        return
    llm = offline_ab.engine(args.model, args.dtype)
    weights = linear_weights(llm)  # packed by the start-up forward
    if not weights or weights[0]._serve_packed[0].is_mkldnn:
        raise SystemExit("the linears are not on the native panels here (`panels_fit`)")
    packs = {
        "panels": [w._serve_packed for w in weights],
        "onednn": [
            (torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16), w._version) for w in weights
        ],
    }

    def user(side: str):
        def use() -> None:
            for w, entry in zip(weights, packs[side], strict=True):
                w._serve_packed = entry

        return use

    use = {side: user(side) for side in ("onednn", "panels")}
    prompts, params = offline_ab.burst(llm, workload.WorkloadSpec.from_args(args))
    if args.decode_steps:
        times = decode_steps(llm, args, use)
        one, two = (statistics.median(times[s]) for s in ("onednn", "panels"))
        print(
            f"decode steps of {args.batch} x ~{args.context} keys, median ms: oneDNN {one:.1f}, "
            f"panels {two:.1f}: {one / two:.2f}x",
            flush=True,
        )
    rates, tokens = offline_ab.alternate(llm, prompts, params, use, args.rounds)
    one, two = (statistics.median(rates[s]) for s in ("onednn", "panels"))
    same = sum(a == b for a, b in zip(tokens["onednn"], tokens["panels"], strict=True))
    print(
        f"burst median oneDNN {one:.1f}, panels {two:.1f} tok/s: {two / one:.2f}x; "
        f"the same tokens in {same} of {len(prompts)} requests"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
