"""Where a decode step's time goes: wall time a step, the device's busy time a step, and
the host's costs (torch ops by `torch.profiler`, Python functions by cProfile).

B prompts of 32 tokens each decode a fixed number of tokens together (offline `LLM`,
prefix caching off); the prefill is included in the wall time, which is small next to
the decode at these lengths. On a GPU, device busy against wall says whether the step is
bound by the device or by the host.

    python benchmarks/step_profile.py --model DIR --batches 1,64 --steps 64 --rows 30 [--eager]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: serve's default model")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--batches", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=64, help="tokens each request decodes")
    p.add_argument("--rows", type=int, default=0, help="print this many rows of each profile")
    p.add_argument(
        "--eager", action="store_true", help="decode steps eager, not replayed as CUDA graphs"
    )
    return p.parse_args()


def main() -> None:
    from serve import LLM, SamplingParams

    args = parse_args()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=False,
        cuda_graphs=not args.eager,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [{"prompt_token_ids": [100 + i + j for j in range(32)]} for i in range(batch)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles, allocates
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
        with profile(activities=activities) as prof:
            llm.generate(prompts, params, use_tqdm=False)
        events = prof.key_averages()
        device_ms = sum(e.self_device_time_total for e in events) / 1e3 / args.steps
        ops_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / args.steps
        print(
            f"== batch {batch}: wall {wall_ms:.2f} ms a step over {args.steps} steps; "
            f"device busy {device_ms:.2f} ms, torch ops' host time {ops_ms:.2f} ms (profiled)"
        )
        if not args.rows:
            continue
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        if on_gpu:
            print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows))
        python_profile = cProfile.Profile()
        python_profile.enable()
        llm.generate(prompts, params, use_tqdm=False)
        python_profile.disable()
        text = io.StringIO()
        pstats.Stats(python_profile, stream=text).sort_stats("tottime").print_stats(args.rows)
        print(text.getvalue())


if __name__ == "__main__":
    main()
