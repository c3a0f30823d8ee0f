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

import offline_ab
import workload


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: serve's default model")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=4, help="runs of each side")
    workload.add_workload_args(p)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    llm = offline_ab.engine(args.model, args.dtype)
    model = llm.engine.executor.worker.model_runner.model
    model = getattr(model, "model", model)  # Llama's, Gemma's, StableLM's body; else the top
    layers = model.h if hasattr(model, "h") else model.layers
    if model.run_layers.stack(layers) is None:
        raise SystemExit("this model's layers do not qualify for the native stack")
    prompts, params = offline_ab.burst(llm, workload.WorkloadSpec.from_args(args))

    def use(stack: bool):
        def switch() -> None:
            model.run_layers.use_stack = stack

        return switch

    sides = {"loop": use(False), "stack": use(True)}
    rates, tokens = offline_ab.alternate(llm, prompts, params, sides, args.rounds)
    loop, stacked = (statistics.median(rates[side]) for side in ("loop", "stack"))
    print(
        f"median loop {loop:.1f}, stack {stacked:.1f} tok/s: {stacked / loop:.2f}x; "
        f"same tokens: {tokens['loop'] == tokens['stack']}"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
