"""The native layer stack against the per-layer Python loop, on compare_peers' burst offline.

One `LLM` (the default model, prefix caching off, a 4 GiB cache), the burst of 64 requests
(prompts 32-512 tokens, outputs 16-256, greedy with `ignore_eos`) run `--rounds` times with
the model's stack (`serve_cpu::decoder_layers`) and with the loop, in ABBA order: the two
sides share the process, the weights and the host's phase. Prints each run's output
tokens/s, the medians' ratio, and whether both sides gave the same tokens.

    python benchmarks/layer_stack.py --dtype float32 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import workload

from serve import LLM, SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: serve's default model")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=4, help="runs of each side")
    workload.add_workload_args(p)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=False,
        kv_cache_memory="4GiB",
        max_model_len=2048,
    )
    model = llm.engine.executor.worker.model_runner.model.model  # LlamaModel, GemmaModel
    if model.run_layers.stack(model.layers) is None:
        raise SystemExit("this model's layers do not qualify for the native stack")
    spec = workload.WorkloadSpec.from_args(args)
    requests = workload.make_requests(spec, workload.ordinary_token_ids(llm.get_tokenizer()))
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.num_output_tokens, ignore_eos=True)
        for r in requests
    ]
    llm.generate(prompts[:3], params[:3], use_tqdm=False)  # warm-up: packs the weights
    rates: dict[str, list[float]] = {"loop": [], "stack": []}
    tokens: dict[str, list] = {}
    for round_ in range(args.rounds):
        for side in ("loop", "stack") if round_ % 2 == 0 else ("stack", "loop"):
            model.run_layers.use_stack = side == "stack"
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            count = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[side].append(count / wall)
            tokens.setdefault(side, [o.outputs[0].token_ids for o in outputs])
            print(f"round {round_} {side}: {count / wall:.1f} tok/s ({wall:.1f} s)", flush=True)
    loop, stacked = (statistics.median(rates[side]) for side in ("loop", "stack"))
    print(
        f"median loop {loop:.1f}, stack {stacked:.1f} tok/s: {stacked / loop:.2f}x; "
        f"same tokens: {tokens['loop'] == tokens['stack']}"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
