"""The host's work per streamed token, this checkout against another, served side by side.

    git worktree add /tmp/base HEAD~3
    python benchmarks/host_overhead.py --base-tree /tmp/base
    python benchmarks/host_overhead.py --base-tree /tmp/base --loads 16x4096 --pairs 3

The model is a 1.6M-parameter random one with the default model's vocabulary and
tokenizer (random_model.py), so the forward is a small part of a step, as for a small
model on a GPU: the host's work decides (the core's scheduling, inputs and sampling; the
API process's text, outputs and SSE). Each server's engine core is held to one thread
(`OMP_NUM_THREADS=1`), leaving the other core to the API process and the client. Pairs run
base, new, then new, base, and so on, because a shared host's speed drifts.

A load `SxL` is S streamed completions of L tokens at once (`serve bench`, `ignore_eos`).
For each run: output tok/s, and the CPU seconds (user + system, from /proc) of the API
process and of the engine core over the run; then each column's median per tree and the
ratio new / base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import random_model
from server_process import start_server, stop_server

NANO = {
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    tree: str
    tokens_per_s: float
    api_cpu_s: float
    core_cpu_s: float


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def engine_core_pid(server_pid: int) -> int:
    """The server's child that runs the engine core (multiprocessing's spawn_main)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if parent == server_pid and b"spawn_main" in cmdline:
            return int(stat.parent.name)
    raise SystemExit(f"no engine core process under server {server_pid}")


def run_once(tree: Path | None, name: str, model: Path, load: str, log_dir: Path) -> Run:
    streams, length = (int(v) for v in load.split("x"))
    os.environ["OMP_NUM_THREADS"] = "1"  # the server's environment: its core on one thread
    flags = ["--max-model-len", str(length + 128)]
    process, url, _ = start_server(str(model), flags, log_dir, name, tree)
    try:
        core = engine_core_pid(process.pid)
        api0, core0 = cpu_seconds(process.pid), cpu_seconds(core)
        out = log_dir / f"bench-{name}-{load}"
        bench = [sys.executable, "-m", "serve.api.cli", "bench", "--base-url", url]
        bench += ["--num-requests", str(streams), "--max-concurrency", str(streams)]
        bench += ["--min-prompt", "32", "--max-prompt", "64"]
        bench += ["--min-output", str(length), "--max-output", str(length), "--ignore-eos"]
        bench += ["--no-plots", "--no-progress", "--output-dir", str(out)]
        subprocess.run(bench, check=True, capture_output=True)
        api_cpu, core_cpu = cpu_seconds(process.pid) - api0, cpu_seconds(core) - core0
    finally:
        stop_server(process)
    summary = json.loads((out / "results.json").read_text())["runs"][0]["summary"]
    return Run(name, summary["output_tokens_per_s"], api_cpu, core_cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-tree", type=Path, required=True, help="a checkout to compare with")
    p.add_argument("--loads", default="16x4096,256x128", help="SxL, comma-separated")
    p.add_argument("--pairs", type=int, default=2, help="per load, alternating in order")
    p.add_argument("--model", type=Path, help="default: the 1.6M-parameter random model")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as tmp:
        log_dir = Path(tmp)
        model = args.model or random_model.build(log_dir / "nano", NANO, seed=0)
        for load in args.loads.split(","):
            runs: list[Run] = []
            for pair in range(args.pairs):
                order = [("base", args.base_tree), ("new", None)]
                for name, tree in order if pair % 2 == 0 else order[::-1]:
                    runs.append(run_once(tree, name, model, load, log_dir))
                    r = runs[-1]
                    print(
                        f"{load} {r.tree:>4}: {r.tokens_per_s:8.0f} tok/s, API CPU "
                        f"{r.api_cpu_s:6.2f} s, core CPU {r.core_cpu_s:6.2f} s",
                        flush=True,
                    )
            streams, length = (int(v) for v in load.split("x"))
            num_tokens = streams * length
            medians = {}
            for tree in ("base", "new"):
                mine = [r for r in runs if r.tree == tree]
                medians[tree] = [
                    statistics.median(getattr(r, field) for r in mine)
                    for field in ("tokens_per_s", "api_cpu_s", "core_cpu_s")
                ]
            base, new = medians["base"], medians["new"]
            print(
                f"{load} medians base / new: {base[0]:.0f} / {new[0]:.0f} tok/s "
                f"({new[0] / base[0]:.2f}x); API CPU {base[1]:.2f} / {new[1]:.2f} s "
                f"({base[1] / num_tokens * 1e6:.0f} / {new[1] / num_tokens * 1e6:.0f} us a "
                f"token, {new[1] / base[1]:.2f}x); core CPU {base[2]:.2f} / {new[2]:.2f} s "
                f"({new[2] / base[2]:.2f}x)"
            )


if __name__ == "__main__":
    main()
