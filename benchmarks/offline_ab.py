"""Two sides of one engine compared on compare_peers' burst offline, in one process.

The benchmarks that switch something inside a running `LLM` (the layer stack against the
loop, the weight panels against oneDNN) share the process, the weights and the host's
phase between the sides; this runs the burst on each in ABBA order and keeps every run's
rate and each side's tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import workload

from serve import LLM, SamplingParams


def engine(model: str | None, dtype: str) -> LLM:
    """The burst's engine: prefix caching off (every prompt computed), a 4 GiB cache."""
    return LLM(
        model=model,
        dtype=dtype,
        enable_prefix_caching=False,
        kv_cache_memory="4GiB",
        max_model_len=2048,
    )


def burst(llm: LLM, spec: workload.WorkloadSpec) -> tuple[list[dict], list[SamplingParams]]:
    """The burst's prompts and greedy `ignore_eos` params; the first three run once as a
    warm-up (it packs the weights)."""
    requests = workload.make_requests(spec, workload.ordinary_token_ids(llm.get_tokenizer()))
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.num_output_tokens, ignore_eos=True)
        for r in requests
    ]
    llm.generate(prompts[:3], params[:3], use_tqdm=False)
    return prompts, params


def alternate(
    llm: LLM,
    prompts: list[dict],
    params: list[SamplingParams],
    sides: dict[str, Callable[[], None]],
    rounds: int,
) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Each round runs the burst once per side (`sides[name]()` switches to it), the order
    turned round every other round. Returns output tokens/s per run and each side's tokens."""
    names = list(sides)
    rates: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list[list[int]]] = {}
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            sides[name]()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            count = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[name].append(count / wall)
            tokens.setdefault(name, [list(o.outputs[0].token_ids) for o in outputs])
            print(f"round {round_} {name}: {count / wall:.1f} tok/s ({wall:.1f} s)", flush=True)
    return rates, tokens
