"""What top-p costs: chat requests sampled at temperature 1 with top_p, each row's nucleus
found among its likeliest tokens (serve's sampler) against every row's vocabulary sorted
whole (as before, and as vLLM's sampler does), on the default model offline.

One `LLM` (prefix caching off), `--num-requests` chat prompts decoding `--max-tokens` each
with `ignore_eos`, both sides in one process in ABBA order (`TOP_P_CANDIDATES` set to the
vocabulary makes every row take the sort). Prints each run's output tokens/s and the
medians' ratio. The tokens differ between runs (unseeded sampling); the work does not.

    python benchmarks/top_p.py --top-p 0.95 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time

from serve import LLM, SamplingParams
from serve.worker import sampler

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
    return p.parse_args()


def main() -> None:
    args = parse_args()
    llm = LLM(model=args.model, enable_prefix_caching=False, max_model_len=2048)
    prompts = [
        [{"role": "user", "content": ASKS[i % len(ASKS)].format(TOPICS[i // len(ASKS) % 8])}]
        for i in range(args.num_requests)
    ]
    params = SamplingParams(
        temperature=1.0, top_p=args.top_p, max_tokens=args.max_tokens, ignore_eos=True
    )
    vocab = llm.get_tokenizer().vocab_size + 1024  # past any vocabulary's padded size
    candidates = sampler.TOP_P_CANDIDATES
    llm.chat(prompts[:2], params, use_tqdm=False)  # warm-up
    rates: dict[str, list[float]] = {"sorted": [], "candidates": []}
    for round_ in range(args.rounds):
        sides = ("sorted", "candidates") if round_ % 2 == 0 else ("candidates", "sorted")
        for side in sides:
            sampler.TOP_P_CANDIDATES = vocab if side == "sorted" else candidates
            start = time.perf_counter()
            outputs = llm.chat(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            count = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[side].append(count / wall)
            print(f"round {round_} {side}: {count / wall:.1f} tok/s ({wall:.1f} s)", flush=True)
    before, after = (statistics.median(rates[side]) for side in ("sorted", "candidates"))
    print(f"median sorted {before:.1f}, candidates {after:.1f} tok/s: {after / before:.2f}x")
    llm.shutdown()


if __name__ == "__main__":
    main()
