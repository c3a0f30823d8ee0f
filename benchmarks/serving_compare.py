"""Before and after, in one run: the same server started in two configurations, each
measured on two loads.

    python benchmarks/serving_compare.py

Configurations (extra `serve` flags, `--before` / `--after` to change them):
  before  API and engine core in one process (the core on a thread sharing the GIL with
          the event loop), one step at a time (`--no-async-scheduling`), prompts
          prefilled whole (`--no-enable-chunked-prefill`);
  after   the defaults: the core in its own process (sending token ids; the API process
          decodes the text), each step scheduled, and the step before's deltas built,
          while the forward before it runs; chunked prefill.
`--before-tree DIR` runs the before server from another checkout (say, a worktree of the
previous version), to compare versions rather than flags.

Loads:
  throughput   the seeded synthetic workload (py's), all requests at once: output
               tokens/s, and the forward's busy fraction from the server's stats lines;
  long-prompt  `--decoders` requests decoding while `--long-prompts` long prompts arrive
               one by one: the decoders' inter-token latency (p50/p99), which a whole-prompt
               prefill stalls and a chunked one does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
from pathlib import Path

import httpx
import workload
from server_process import start_server, stop_server
from workload import Request, WorkloadSpec

from serve.bench.client import get_model, replay, send
from serve.bench.report import latency_stats, summarize

BEFORE = "--disable-frontend-multiprocessing --no-enable-chunked-prefill --no-async-scheduling"
AFTER = ""
BUSY_LINE = re.compile(r"forward busy (\d+)%")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: serve's default model")
    p.add_argument("--before", default=BEFORE, help="serve flags of the 'before' server")
    p.add_argument("--after", default=AFTER, help="serve flags of the 'after' server")
    p.add_argument(
        "--before-tree", type=Path, default=None, help="run the 'before' server from this checkout"
    )
    p.add_argument(
        "--common",
        default="--max-model-len 2048",
        help="serve flags of both",
    )
    workload.add_workload_args(p)
    p.set_defaults(num_requests=32, max_output=128)
    p.add_argument("--decoders", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument("--long-prompts", type=int, default=3)
    p.add_argument("--long-prompt-tokens", type=int, default=1800)
    p.add_argument("--long-prompt-every-s", type=float, default=4.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    return p.parse_args()


def busy_fraction(log_text: str) -> float | None:
    """The mean of the stats lines' forward busy fractions (logged every 5 s under load)."""
    values = [int(v) / 100 for v in BUSY_LINE.findall(log_text)]
    return sum(values) / len(values) if values else None


async def throughput_load(url: str, requests: list[Request], args) -> dict:
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        model, _ = await get_model(client, None)
        warmup = await send(client, model, Request(requests[0].prompt_token_ids[:8], 2), 0.0)
        if warmup.error is not None:
            raise SystemExit(f"serving_compare: the warm-up request failed: {warmup.error}")
        results, duration = await replay(client, model, requests, seed=args.seed)
    return summarize(results, duration)


async def long_prompt_load(url: str, token_ids: list[int], args) -> dict:
    """The decoders start together; the long prompts arrive while they decode."""
    spec = WorkloadSpec(args.decoders, 32, 64, args.decode_tokens, args.decode_tokens, args.seed)
    decoders = workload.make_requests(spec, token_ids)
    long_spec = WorkloadSpec(
        args.long_prompts, args.long_prompt_tokens, args.long_prompt_tokens, 4, 4, args.seed + 7
    )
    long_prompts = workload.make_requests(long_spec, token_ids)
    limits = httpx.Limits(max_connections=args.decoders + args.long_prompts)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        model, _ = await get_model(client, None)
        decoding = [asyncio.create_task(send(client, model, r, 0.0)) for r in decoders]
        long_tasks = []
        for r in long_prompts:
            await asyncio.sleep(args.long_prompt_every_s)
            long_tasks.append(asyncio.create_task(send(client, model, r, 0.0)))
        results = await asyncio.gather(*decoding)
        long_results = await asyncio.gather(*long_tasks)
    ok = [r for r in results if r.is_success]
    return {
        "decoders_ok": len(ok),
        "long_prompts_ok": sum(r.is_success for r in long_results),
        "itl_ms": latency_stats([gap for r in ok for gap in r.itl_s]),
        "long_prompt_ttft_ms": latency_stats([r.ttft_s for r in long_results if r.is_success]),
    }


def measure(name: str, flags: str, args, requests, token_ids, tree: Path | None = None) -> dict:
    model_flags = shlex.split(args.common) + shlex.split(flags)
    process, url, log_path = start_server(
        args.model, model_flags, args.log_dir, f"compare-{name}", tree
    )
    try:
        start = len(log_path.read_text())
        throughput = asyncio.run(throughput_load(url, requests, args))
        busy = busy_fraction(log_path.read_text()[start:])
        long_prompt = asyncio.run(long_prompt_load(url, token_ids, args))
    finally:
        stop_server(process)
    result = {"flags": flags, "throughput": throughput, "busy": busy, "long_prompt": long_prompt}
    itl = long_prompt["itl_ms"]
    print(
        f"{name:<7} output {throughput['output_tokens_per_s']:6.1f} tok/s "
        f"({throughput['num_successful']}/{len(requests)} ok), forward busy "
        f"{'-' if busy is None else f'{busy:.0%}'}; with long prompts arriving: ITL p50 "
        f"{itl['p50']:.0f} ms, p99 {itl['p99']:.0f} ms",
        flush=True,
    )
    return result


def main() -> None:
    args = parse_args()
    from serve.models.loader import resolve_model_path
    from serve.models.tokenizer import load_tokenizer

    token_ids = workload.ordinary_token_ids(load_tokenizer(resolve_model_path(args.model)))
    requests = workload.make_requests(WorkloadSpec.from_args(args), token_ids)
    before = measure("before", args.before, args, requests, token_ids, args.before_tree)
    after = measure("after", args.after, args, requests, token_ids)
    speedup = (
        after["throughput"]["output_tokens_per_s"] / before["throughput"]["output_tokens_per_s"]
    )
    itl_ratio = after["long_prompt"]["itl_ms"]["p99"] / before["long_prompt"]["itl_ms"]["p99"]
    print(
        f"after / before output tok/s: {speedup:.2f}x; p99 ITL under long prompts: {itl_ratio:.2f}x"
    )
    if args.json:
        payload = {"args": vars(args), "before": before, "after": after}
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
