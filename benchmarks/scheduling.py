"""sjf against fcfs on a mixed workload: short answers and long essays, Poisson arrivals.

Half the requests ask for a one-word answer and get a few tokens, half ask for an essay
and get hundreds; the class shows in the prompt's wording. Decoding is greedy, so both
runs do the same work. `--lengths` says how the lengths are had:

- `max_tokens`: each request's `max_tokens` is its length, with `ignore_eos`. The server
  sees the length in the request (sjf's predictor learns from `max_tokens`).
- `prompt`: every request has the same `max_tokens` (the long range's top); an essay is
  held to its length with `min_tokens`, a short answer ends at the model's end of turn.
  Nothing but the prompt's wording tells the server which is which. Each policy gets a server of its own
(same flags otherwise), a warm-up of requests from the same mix (sjf's predictor learns
from them; fcfs gets them too), then the measured requests at `--load` times the
capacity measured first (all requests of a calibration set at once, under fcfs).

    python benchmarks/scheduling.py --max-num-seqs 16 --num-requests 240
    python benchmarks/scheduling.py --max-num-seqs 4 --lengths prompt --num-requests 160

Reports, per policy: throughput, mean and p90 of E2E latency and TTFT, for all requests
and per class, the longest queue wait the server's histogram allows (its
`serve_request_queue_time_seconds` bucket bound), and under sjf the longest any request
waited while later arrivals ran (`serve_sjf_longest_passed_over_seconds`), which
--sjf-max-wait-s bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
from server_process import start_server, stop_server
from workload import Request

from serve.bench.client import RequestResult, send
from serve.bench.report import latency_stats

TOPICS = (
    "the ocean",
    "mountains",
    "the moon",
    "trains",
    "coffee",
    "libraries",
    "rivers",
    "bees",
    "winter",
    "bridges",
    "the desert",
    "music",
    "gardens",
    "volcanoes",
    "clocks",
    "islands",
    "forests",
    "cities",
    "rain",
    "paper",
    "glass",
    "salt",
    "maps",
    "lighthouses",
)
SHORT_ASKS = (
    "Answer in one word: what colour is {}?",
    "One word only: is {} big or small?",
    "Reply with a single word that describes {}.",
)
LONG_ASKS = (
    "Write a long, detailed essay about the history of {}, with many paragraphs.",
    "Write an extended story of several pages about {}, full of detail.",
    "Compose a thorough, multi-section report on {} and everything around it.",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: serve's default model")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=240, help="measured, per policy")
    p.add_argument("--num-warmup", type=int, default=64, help="sent first, not measured")
    p.add_argument("--num-calibration", type=int, default=64)
    p.add_argument(
        "--capacity",
        type=float,
        default=None,
        help="requests/s, instead of calibrating: the measured capacity varies ~10%% run to "
        "run, and with it the load sent, so pass one to compare runs of a seed",
    )
    p.add_argument("--load", type=float, default=0.8, help="arrival rate / capacity")
    p.add_argument("--short", type=int, nargs=2, default=(2, 8), help="output token range")
    p.add_argument("--long", type=int, nargs=2, default=(150, 250), help="output token range")
    p.add_argument("--lengths", choices=("max_tokens", "prompt"), default="max_tokens")
    p.add_argument("--sjf-max-wait-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return p.parse_args()


def make_mix(n: int, args: argparse.Namespace, seed: int) -> list[tuple[str, bool, int]]:
    """(prompt text, is_long, output tokens) for n requests, half of each class."""
    rng = random.Random(seed)
    mix = []
    for i in range(n):
        is_long = i % 2 == 1
        ask = rng.choice(LONG_ASKS if is_long else SHORT_ASKS).format(rng.choice(TOPICS))
        low, high = args.long if is_long else args.short
        mix.append((ask, is_long, rng.randint(low, high)))
    rng.shuffle(mix)
    return mix


async def tokenize(client: httpx.AsyncClient, model: str, text: str) -> list[int]:
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    response = await client.post("/tokenize", json=body)
    response.raise_for_status()
    return response.json()["tokens"]


def request_for(
    prompt: list[int], is_long: bool, num_tokens: int, args: argparse.Namespace
) -> tuple[Request, bool, dict]:
    """The request, its `ignore_eos` and its extra body fields, per `--lengths`."""
    if args.lengths == "max_tokens":
        return Request(prompt, num_tokens), True, {}
    cap = args.long[1]
    return Request(prompt, cap), False, {"min_tokens": num_tokens if is_long else 0}


async def run_mix(
    client: httpx.AsyncClient,
    model: str,
    mix: list[tuple[str, bool, int]],
    rate: float,
    seed: int,
    args: argparse.Namespace,
) -> tuple[list[tuple[bool, RequestResult]], float]:
    prompts = {text: await tokenize(client, model, text) for text, _, _ in mix}
    arrivals = random.Random(seed)
    start = time.perf_counter()
    tasks = []
    for text, is_long, num_tokens in mix:
        request, ignore_eos, extra = request_for(prompts[text], is_long, num_tokens, args)
        sent = send(client, model, request, 0.0, ignore_eos, extra)
        tasks.append((is_long, asyncio.create_task(sent)))
        if rate != float("inf"):
            await asyncio.sleep(arrivals.expovariate(rate))
    results = [(is_long, await task) for is_long, task in tasks]
    return results, time.perf_counter() - start


def summarize(results: list[tuple[bool, RequestResult]], duration_s: float) -> dict:
    # Success is an error-free stream: under `--lengths prompt` short answers end where
    # the model ends them, not at the `max_tokens` asked for.
    ok = [(is_long, r) for is_long, r in results if r.error is None and r.num_output_tokens]
    summary = {
        "num_successful": len(ok),
        "num_failed": len(results) - len(ok),
        "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s,
        "output_tokens_per_s": sum(r.num_output_tokens for _, r in ok) / duration_s,
    }
    for name, keep in (("all", lambda _: True), ("short", lambda x: not x), ("long", bool)):
        chosen = [r for is_long, r in ok if keep(is_long)]
        summary[name] = {
            "e2e_ms": latency_stats([r.e2e_s for r in chosen]),
            "ttft_ms": latency_stats([r.ttft_s for r in chosen if r.ttft_s is not None]),
            "mean_output_tokens": sum(r.num_output_tokens for r in chosen) / max(1, len(chosen)),
        }
    return summary


def gauge(metrics_text: str, name: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        if family.name == name:
            return family.samples[0].value
    return None


def longest_queue_wait_bound(metrics_text: str) -> float:
    """The smallest histogram bound that every observed queue wait is under."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[float, float] = {}
    count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "serve_request_queue_time_seconds":
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                bound = float(s.labels["le"])
                totals[bound] = totals.get(bound, 0.0) + s.value
            elif s.name.endswith("_count"):
                count += s.value
    return min((b for b, c in totals.items() if c >= count), default=float("inf"))


async def measure(url: str, mix, rate: float, args, seed: int) -> tuple[dict, str]:
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        warmup = make_mix(args.num_warmup, args, seed=args.seed + 100)
        if warmup:
            await run_mix(client, model, warmup, rate, args.seed + 101, args)
        results, duration = await run_mix(client, model, mix, rate, seed, args)
        metrics = (await client.get("/metrics")).text
    return summarize(results, duration), metrics


def calibrate(args: argparse.Namespace, flags: list[str], log_dir: Path) -> float:
    """Requests/s a fcfs server completes with a calibration mix sent all at once."""
    process, url, _ = start_server(
        args.model, [*flags, "--scheduling-policy", "fcfs"], log_dir, "calibrate"
    )
    calibration = make_mix(args.num_calibration, args, seed=args.seed + 200)

    async def run() -> float:
        async with httpx.AsyncClient(base_url=url, timeout=None) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            results, duration = await run_mix(client, model, calibration, float("inf"), 0, args)
        return sum(r.error is None for _, r in results) / duration

    try:
        return asyncio.run(run())
    finally:
        stop_server(process)


def main() -> None:
    args = parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-scheduling-"))
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--sjf-max-wait-s", str(args.sjf_max_wait_s)]
    report: dict = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }

    capacity = args.capacity or calibrate(args, flags, log_dir)
    rate = args.load * capacity
    report.update(capacity_requests_per_s=capacity, rate_requests_per_s=rate)
    print(f"capacity {capacity:.2f} req/s; sending {rate:.2f} req/s", flush=True)

    mix = make_mix(args.num_requests, args, seed=args.seed)
    for policy in ("fcfs", "sjf"):
        process, url, _ = start_server(
            args.model, [*flags, "--scheduling-policy", policy], log_dir, policy
        )
        try:
            summary, metrics = asyncio.run(measure(url, mix, rate, args, seed=args.seed + 1))
        finally:
            stop_server(process)
        summary["longest_queue_wait_at_most_s"] = wait_bound = longest_queue_wait_bound(metrics)
        # sjf: what its bound limits, over the warm-up and the measured requests.
        passed_over = gauge(metrics, "serve_sjf_longest_passed_over_seconds")
        summary["longest_passed_over_s"] = passed_over
        report[policy] = summary
        a = summary["all"]
        print(
            f"{policy}: {summary['requests_per_s']:.2f} req/s, "
            f"{summary['output_tokens_per_s']:.0f} tok/s; E2E mean {a['e2e_ms']['mean']:.0f} "
            f"p90 {a['e2e_ms']['p90']:.0f} ms; TTFT mean {a['ttft_ms']['mean']:.0f} "
            f"p90 {a['ttft_ms']['p90']:.0f} ms; short E2E mean "
            f"{summary['short']['e2e_ms']['mean']:.0f} ms, long "
            f"{summary['long']['e2e_ms']['mean']:.0f} ms; TTFT p99 {a['ttft_ms']['p99']:.0f} ms; "
            f"queue wait <= {wait_bound} s; "
            + ("" if passed_over is None else f"longest passed over {passed_over:.1f} s; ")
            + f"failed {summary['num_failed']}",
            flush=True,
        )
    fcfs, sjf = report["fcfs"]["all"], report["sjf"]["all"]
    report["sjf_over_fcfs"] = {
        "e2e_mean": sjf["e2e_ms"]["mean"] / fcfs["e2e_ms"]["mean"],
        "e2e_p90": sjf["e2e_ms"]["p90"] / fcfs["e2e_ms"]["p90"],
        "ttft_mean": sjf["ttft_ms"]["mean"] / fcfs["ttft_ms"]["mean"],
        "ttft_p90": sjf["ttft_ms"]["p90"] / fcfs["ttft_ms"]["p90"],
        "throughput": report["sjf"]["requests_per_s"] / report["fcfs"]["requests_per_s"],
    }
    print("sjf / fcfs:", json.dumps(report["sjf_over_fcfs"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
