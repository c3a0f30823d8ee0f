"""What paged KV sharing saves: blocks, waste, and time to first token.

Three measurements on one model, in one run:

1. Peak KV blocks for n=4 parallel sampling and beam width 4 on one long prompt, with
   sharing (one request whose sequences fork the prompt's blocks) against without: four
   independent requests with prefix caching off, and for beams the W full copies of the
   prompt and output that a per-beam contiguous cache (HF transformers) holds.
2. Waste on the seeded synthetic workload: allocated token slots holding no token, as a
   fraction of allocated slots, sampled after every engine step.
3. Time to first token of a request whose long system prompt is already in the prefix
   cache, against the same request on a cold cache.

    python benchmarks/kv_sharing.py                       # the default model, CPU
    python benchmarks/kv_sharing.py --prompt-len 64 --max-tokens 16 --num-requests 8
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import workload
from workload import WorkloadSpec

from serve import LLM, SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: the default model)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens for part 1")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens for part 1")
    p.add_argument("--width", type=int, default=4, help="n and beam width for part 1")
    p.add_argument("--system-len", type=int, default=1000, help="system prompt for part 3")
    p.add_argument("--ttft-repeats", type=int, default=5)
    p.add_argument("--skip-waste", action="store_true", help="skip part 2 (the slow one)")
    workload.add_workload_args(p)
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args()


def peak_blocks(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> int:
    llm.reset_peak()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm.stats().peak_num_blocks_used


def measure_sharing(args: argparse.Namespace, shared: LLM, unshared: LLM, vocab: list[int]):
    import random

    rng = random.Random(args.seed)
    prompt = [rng.choice(vocab) for _ in range(args.prompt_len)]
    w, max_tokens = args.width, args.max_tokens

    def sample(n: int, seed: int) -> SamplingParams:
        return SamplingParams(
            n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True
        )

    forked = peak_blocks(shared, [prompt], [sample(w, 0)])
    separate = peak_blocks(unshared, [prompt] * w, [sample(1, i) for i in range(w)])

    shared.reset_peak()
    shared.beam_search(
        [{"prompt_token_ids": prompt}], w, max_tokens, ignore_eos=True, use_tqdm=False
    )
    beams = shared.stats().peak_num_blocks_used
    block_size = shared.engine.block_manager.block_size
    beams_unshared = w * -(-(args.prompt_len + max_tokens) // block_size)
    return {
        "prompt_len": args.prompt_len,
        "max_tokens": max_tokens,
        "width": w,
        "block_size": block_size,
        "parallel_sampling_blocks_shared": forked,
        "parallel_sampling_blocks_unshared": separate,
        "parallel_sampling_saving": 1 - forked / separate,
        "beam_search_blocks_shared": beams,
        "beam_search_blocks_unshared": beams_unshared,
        "beam_search_saving": 1 - beams / beams_unshared,
    }


def measure_waste(args: argparse.Namespace, llm: LLM, vocab: list[int]) -> dict[str, Any]:
    engine = llm.engine
    requests = workload.make_requests(WorkloadSpec.from_args(args), vocab)
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=r.num_output_tokens, ignore_eos=True)
        engine.add_request(f"waste-{i}", r.prompt_token_ids, params)
    samples, used = [], []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        if stats.num_blocks_used:
            samples.append(stats.kv_waste_fraction)
            used.append(stats.num_blocks_used)
    weighted = sum(f * u for f, u in zip(samples, used)) / sum(used)
    return {
        "num_requests": len(requests),
        "num_steps": len(samples),
        "waste_mean": statistics.fmean(samples),
        "waste_weighted_by_blocks": weighted,
        "waste_max": max(samples),
    }


def time_to_first_token(llm: LLM, prompt: list[int]) -> float:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1)
    start = time.perf_counter()
    engine.add_request(f"ttft-{start}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def measure_ttft(args: argparse.Namespace, llm: LLM, vocab: list[int]) -> dict[str, Any]:
    import random

    rng = random.Random(args.seed + 1)
    cold, warm = [], []
    hits = queries = 0  # the cached turns' own prefix-cache lookups
    for _ in range(args.ttft_repeats):
        system = [rng.choice(vocab) for _ in range(args.system_len)]
        first_turn = system + [rng.choice(vocab) for _ in range(24)]
        second_turn = system + [rng.choice(vocab) for _ in range(24)]
        cold.append(time_to_first_token(llm, first_turn))  # a new system prompt: a miss
        before = llm.stats()
        warm.append(time_to_first_token(llm, second_turn))  # same system prompt: a hit
        after = llm.stats()
        hits += after.prefix_cache_hits - before.prefix_cache_hits
        queries += after.prefix_cache_queries - before.prefix_cache_queries
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    return {
        "system_len": args.system_len,
        "ttft_uncached_s": cold_s,
        "ttft_cached_s": warm_s,
        "speedup": cold_s / warm_s,
        "hit_rate": hits / queries if queries else 0.0,  # the cached turns' tokens found
    }


def main() -> None:
    args = parse_args()
    shared = LLM(args.model)
    unshared = LLM(args.model, enable_prefix_caching=False)
    vocab = workload.ordinary_token_ids(shared.get_tokenizer())
    time_to_first_token(shared, vocab[:8])  # warm-up: first-call allocations

    results: dict[str, Any] = {"machine": platform.machine(), "model": args.model or "default"}
    results["sharing"] = sharing = measure_sharing(args, shared, unshared, vocab)
    print(
        f"n={sharing['width']} parallel sampling, {sharing['prompt_len']}-token prompt, "
        f"{sharing['max_tokens']} tokens each: {sharing['parallel_sampling_blocks_shared']} "
        f"blocks shared vs {sharing['parallel_sampling_blocks_unshared']} unshared "
        f"({100 * sharing['parallel_sampling_saving']:.1f}% saved)"
    )
    print(
        f"beam width {sharing['width']}: {sharing['beam_search_blocks_shared']} blocks vs "
        f"{sharing['beam_search_blocks_unshared']} for per-beam copies "
        f"({100 * sharing['beam_search_saving']:.1f}% saved)"
    )
    del unshared

    if not args.skip_waste:
        results["waste"] = waste = measure_waste(args, shared, vocab)
        print(
            f"waste over {waste['num_steps']} steps of {waste['num_requests']} requests: "
            f"mean {100 * waste['waste_mean']:.2f}%, weighted by blocks "
            f"{100 * waste['waste_weighted_by_blocks']:.2f}%, max {100 * waste['waste_max']:.2f}%"
        )

    results["ttft"] = ttft = measure_ttft(args, shared, vocab)
    print(
        f"TTFT with a {ttft['system_len']}-token system prompt: uncached "
        f"{1000 * ttft['ttft_uncached_s']:.0f} ms, cached {1000 * ttft['ttft_cached_s']:.0f} ms "
        f"({ttft['speedup']:.1f}x)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
