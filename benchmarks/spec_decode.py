"""Speculative decoding against plain decoding, side by side in one run (offline `LLM`).

Batch 1: each prompt of a copy-heavy set (edit a given passage, rename an identifier in
given code, answer from a given passage) runs alone, greedy, once per engine, the engines
taking turns prompt by prompt so that a slow moment of the machine hits both. Reported:
output tokens per second of each engine and their ratio, with n-gram's acceptance.

Batch 64: 64 requests at once (the same prompts, repeated), where speculation with
`disable_by_batch_size` should switch itself off until the batch drains to that size:
throughput of each engine.

    python benchmarks/spec_decode.py                       # default model, n-gram k=4
    python benchmarks/spec_decode.py --draft /tmp/draft    # a draft model as well
    python benchmarks/spec_decode.py --skip-batch          # batch 1 only
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

from serve import LLM, SamplingParams

KV_CACHE = "1GiB"  # per engine: two or three are loaded at once

PASSAGE = (
    "The lighthouse stood at the edge of the cliff for more than a hundred years. Every "
    "night its keeper climbed the narrow stairs, trimmed the wick and wound the clockwork "
    "that turned the great lens. Ships passing in the dark saw its beam sweep across the "
    "water once every ten seconds, and they knew where the rocks were. When the keeper "
    "grew old, the lamp was replaced by an electric one, and the stairs were climbed only "
    "once a month, to check the bulbs and to clean the salt from the windows."
)
TYPO_PASSAGE = (
    PASSAGE.replace("narrow", "narow").replace("water", "watter").replace("replaced", "replased")
)
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal = subtotal + item.price * item.quantity
    tax = subtotal * tax_rate
    total = subtotal + tax
    return total


def average_price(items):
    subtotal = 0
    for item in items:
        subtotal = subtotal + item.price
    return subtotal / len(items)
"""
PROMPTS = [
    "Fix the spelling mistakes in this paragraph and write it out again in full:\n\n"
    + TYPO_PASSAGE,
    "Rename the variable `subtotal` to `running_sum` in this code and show the whole code:\n\n"
    + CODE,
    f"Repeat the following paragraph exactly, word for word:\n\n{PASSAGE}",
    f"Read this paragraph, then write it again with 'lighthouse' replaced by 'tower':\n\n{PASSAGE}",
]


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def _timed_chat(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[int, float]:
    start = time.perf_counter()
    outs = llm.chat([_messages(p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), elapsed


def _spec_counts(llm: LLM) -> tuple[int, int, int]:
    spec = llm.engine.stats().spec_decode
    if spec is None:
        return 0, 0, 0
    return spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens


def batch_one(engines: dict[str, LLM], max_tokens: int, rounds: int) -> dict[str, dict]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for llm in engines.values():  # warm-up: first-step costs, the chat template
        _timed_chat(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8))
    totals = {name: [0, 0.0] for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    before = {name: _spec_counts(llm) for name, llm in engines.items()}
    for _ in range(rounds):
        for prompt in PROMPTS:
            for name, llm in engines.items():
                start = time.perf_counter()
                (out,) = llm.chat([_messages(prompt)], params, use_tqdm=False)
                totals[name][1] += time.perf_counter() - start
                totals[name][0] += len(out.outputs[0].token_ids)
                outputs[name].append(out.outputs[0].token_ids)
    base = next(iter(engines))
    result = {}
    for name, llm in engines.items():
        drafts, proposed, accepted = (
            a - b for a, b in zip(_spec_counts(llm), before[name], strict=True)
        )
        tokens, seconds = totals[name]
        result[name] = {
            "tokens": tokens,
            "seconds": round(seconds, 2),
            "tok_s": round(tokens / seconds, 2),
            "same_tokens_as_plain": outputs[name] == outputs[base],
            "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
            "mean_accepted_length": round(1 + accepted / drafts, 2) if drafts else None,
        }
    return result


def batch_many(engines: dict[str, LLM], num_requests: int, max_tokens: int) -> dict[str, dict]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] + f"\n\n(Copy {i}.)" for i in range(num_requests)]
    result = {}
    for name, llm in engines.items():
        before = _spec_counts(llm)
        tokens, seconds = _timed_chat(llm, prompts, params)
        drafts = _spec_counts(llm)[0] - before[0]
        result[name] = {
            "tokens": tokens,
            "seconds": round(seconds, 2),
            "tok_s": round(tokens / seconds, 2),
            "drafts": drafts,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--draft", default=None, help="a draft model's directory, also run")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-batch", action="store_true", help="batch 1 only")
    parser.add_argument("--skip-batch-one", action="store_true", help="the batch part only")
    parser.add_argument("--batch-requests", type=int, default=64)
    parser.add_argument("--batch-max-tokens", type=int, default=32)
    parser.add_argument("--disable-by-batch-size", type=int, default=4)
    args = parser.parse_args()

    ngram = {"method": "ngram", "num_speculative_tokens": args.k}
    configs: dict[str, dict | None] = {"plain": None, f"ngram k={args.k}": ngram}
    if args.draft:
        configs[f"draft k={args.k}"] = {
            "method": "draft_model",
            "model": args.draft,
            "num_speculative_tokens": args.k,
        }
    engines = {
        name: LLM(model=args.model, kv_cache_memory=KV_CACHE, speculative_config=config)
        for name, config in configs.items()
    }
    report: dict = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,  # the repository's, wherever it runs from
        ).stdout.strip(),
    }
    if not args.skip_batch_one:
        report["batch_1"] = batch_one(engines, args.max_tokens, args.rounds)
    print("batch 1 (greedy, copy-heavy prompts, one at a time):")
    for name, row in report.get("batch_1", {}).items():
        base = report["batch_1"]["plain"]["tok_s"]
        print(
            f"  {name:12s} {row['tok_s']:7.2f} tok/s  {row['tok_s'] / base:5.2f}x  "
            f"same tokens: {row['same_tokens_as_plain']}  acceptance: "
            f"{row['acceptance_rate']}  mean accepted length: {row['mean_accepted_length']}"
        )
    if not args.skip_batch:
        for name in list(engines)[1:]:
            engines.pop(name).shutdown()
        many = {
            "plain": engines["plain"],
            f"ngram k={args.k}, disable_by_batch_size={args.disable_by_batch_size}": LLM(
                model=args.model,
                kv_cache_memory=KV_CACHE,
                speculative_config={**ngram, "disable_by_batch_size": args.disable_by_batch_size},
            ),
        }
        for llm in many.values():  # the new engine's first steps, as the others had theirs
            _timed_chat(llm, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=8))
        runs = [batch_many(many, args.batch_requests, args.batch_max_tokens) for _ in range(2)]
        report[f"batch_{args.batch_requests}"] = runs
        print(f"{args.batch_requests} requests at once ({args.batch_max_tokens} tokens each):")
        for run in runs:
            plain = run["plain"]["tok_s"]
            for name, row in run.items():
                print(
                    f"  {name:40s} {row['tok_s']:7.2f} tok/s  {row['tok_s'] / plain:5.2f}x  "
                    f"drafts: {row['drafts']}"
                )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
