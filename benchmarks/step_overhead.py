"""What a steady decode step sends to the workers, and what it costs outside the forward.

64 requests decode together on the default model (offline `LLM`, float32). Over the steps
where all 64 decode one token each, this reports:

- bytes per step: the message a worker process would receive. Today that is the
  SchedulerOutput as the `mp` executor encodes it (msgspec). Before the worker boundary
  (`--before-tree` pointing at an older checkout) the scheduler's output held live
  sequences, so the nearest equivalent is that object pickled as it was;
- per step: wall time, forward time, and the rest (wall - forward), with steps scheduled
  ahead and one at a time.

    python benchmarks/step_overhead.py
    python benchmarks/step_overhead.py --before-tree /path/to/older/checkout
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: serve's default model")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--before-tree", type=Path, default=None, help="also measure this checkout")
    p.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.output_len < 8:  # the first steps warm up: too few leave no steady step to time
        p.error(f"--output-len must be at least 8, got {args.output_len}")
    return args


def _message_size(out) -> int:
    try:
        from serve.executor.messages import ExecuteModel, encode
    except ImportError:  # before the worker boundary: the live objects, pickled
        return len(pickle.dumps(out, protocol=5))
    return len(encode(ExecuteModel(out)))


def measure(args: argparse.Namespace, async_scheduling: bool) -> dict:
    from serve import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype="float32",
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_seqs):
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
        llm.add_request(f"r{i}", prompt, params)
    scheduler, engine = llm.engine.scheduler, llm.engine
    schedule = scheduler.schedule
    sizes: list[int] = []

    def recording_schedule():
        out = schedule()
        steady = len(out.scheduled) == args.num_seqs
        if steady and all(s.num_new_tokens == 1 for s in out.scheduled):
            sizes.append(_message_size(out))
        return out

    scheduler.schedule = recording_schedule
    walls, forwards = [], []
    while llm.has_unfinished_requests():
        before_forward = engine.step_times.forward_s
        num_steady = len(sizes)
        start = time.perf_counter()
        llm.step()
        if len(sizes) > num_steady and num_steady > 2:  # a steady step, past warm-up
            walls.append(time.perf_counter() - start)
            forwards.append(engine.step_times.forward_s - before_forward)
    return {
        "async_scheduling": async_scheduling,
        "steady_steps": len(walls),
        "bytes_per_step": statistics.median(sizes),
        "wall_ms": 1000 * statistics.median(walls),
        "forward_ms": 1000 * statistics.median(forwards),
        "outside_forward_ms": 1000 * statistics.median(w - f for w, f in zip(walls, forwards)),
    }


def main() -> None:
    args = parse_args()
    results = [measure(args, True), measure(args, False)]
    if args.json_only:
        print(json.dumps(results))
        return
    rows = [("this tree", r) for r in results]
    if args.before_tree is not None:
        cmd = [sys.executable, __file__, "--json-only", "--num-seqs", str(args.num_seqs)]
        cmd += ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
        if args.model:
            cmd += ["--model", args.model]
        env = {**os.environ, "PYTHONPATH": str(args.before_tree.resolve())}
        done = subprocess.run(cmd, env=env, cwd=args.before_tree, capture_output=True, text=True)
        if done.returncode:
            sys.exit(done.stderr)
        rows = [("before", r) for r in json.loads(done.stdout.splitlines()[-1])] + rows
    print(f"{args.num_seqs} sequences decoding; medians over steady steps")
    print(
        f"{'tree':10} {'async':>5} {'steps':>5} {'bytes/step':>10} {'wall ms':>8} "
        f"{'forward ms':>10} {'outside ms':>10}"
    )
    for name, r in rows:
        print(
            f"{name:10} {'on' if r['async_scheduling'] else 'off':>5} {r['steady_steps']:5d} "
            f"{r['bytes_per_step']:10.0f} {r['wall_ms']:8.1f} {r['forward_ms']:10.1f} "
            f"{r['outside_forward_ms']:10.1f}"
        )


if __name__ == "__main__":
    main()
