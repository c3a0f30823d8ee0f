"""The CPU speed levers, each an A/B in one run: steady decode step time and prefill speed
of the default model (offline `LLM`, greedy), with a lever off and on.

    python benchmarks/cpu_levers.py                       # every lever, batch 1 and 64
    python benchmarks/cpu_levers.py --levers native --batch-sizes 64

Each configuration runs in a fresh process (the levers are read at start-up), one after
the other, on the same prompts. For each batch size B it reports the median wall time of
the steps in which all B sequences decode one token (past a few warm-up steps), the
output tokens/s that makes, and the prefill throughput of the batch's prompts. Batch 1 is
also compared with the bandwidth floor: the model's weight bytes over the machine's
memory read bandwidth (measured here: the best of a few sums over a 512 MiB tensor).

`--attention-crossover` instead times attention on prompt chunks of growing length (8
sequences, the default model's 9 query / 3 KV heads of 64): the native kernel (reading
K/V in place; a key per vector lane below `kWideMinQueries` queries in
csrc/paged_attention.cpp, a query per lane from there) against the torch reference
(gathering each context, then torch's fused attention).

Levers (name: the A and B configurations):
  native     SERVE_CPU_KERNELS=0 (torch only: attention gathers each sequence's K/V, then
             runs torch's fused attention; one-row products in MKL) vs the native kernels
             (attention reading K/V in place; one row's product streaming the weights)
  prepack    SERVE_CPU_PREPACK=0 (linears of two rows and up in MKL's sgemm, as W @ x^T below
             128 rows) vs oneDNN with each weight reordered once into its blocked layout
  allocator  glibc malloc vs tcmalloc preloaded (Debian's libtcmalloc-minimal4), as
             vLLM's CPU docs advise
  dtype      float32 vs bfloat16 (worth it only where the CPU has AVX512_BF16 or AMX)
  block_size KV blocks of 16 tokens vs 128 (vLLM's CPU default): a sequence's K/V in
             fewer, longer runs that the prefetchers follow
  affinity   OpenMP threads free to move vs each bound to a core (OMP_PROC_BIND=close,
             OMP_PLACES=cores), as vLLM binds its CPU workers' threads
  hugepages  torch's CPU allocations in 4 KiB pages vs 2 MiB transparent huge pages
             (THP_MEM_ALLOC_ENABLE=1: blocks of 2 MiB and more, the weights, their oneDNN
             copies and the KV cache among them, advised MADV_HUGEPAGE)

`--decode-attention` times decode attention alone at the default model's shapes (64
sequences of 400 keys, 9/3 heads of 64, 30 layers' caches in a pool the size of a 4 GiB
cache, each sequence's blocks one run), on one thread and on all, as GB/s of K/V read,
beside a plain sum's read bandwidth.

`--baseline-tree DIR` adds the lever `tree`: A imports serve from the checkout DIR (say
`git worktree add /tmp/base HEAD~1`), B from this one, so a kernel change is measured
against the commit before it, each side with its own native build.

`--rounds N` runs each lever's A and B N times, alternating, and prints every round: on a
shared machine the speed moves between minutes, and only side-by-side pairs compare.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

LEVERS = {
    "native": (("torch", {"SERVE_CPU_KERNELS": "0"}, {}), ("native", {}, {})),
    "prepack": (("mkl", {"SERVE_CPU_PREPACK": "0"}, {}), ("onednn", {}, {})),
    "allocator": (
        ("glibc", {}, {}),
        ("tcmalloc", {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}, {}),
    ),
    "dtype": (("float32", {}, {}), ("bfloat16", {}, {"dtype": "bfloat16"})),
    "block_size": (("16", {}, {"block_size": 16}), ("128", {}, {"block_size": 128})),
    "affinity": (
        ("unbound", {}, {}),
        ("bound", {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}, {}),
    ),
    "hugepages": (
        ("4k", {"THP_MEM_ALLOC_ENABLE": "0"}, {}),
        ("thp", {"THP_MEM_ALLOC_ENABLE": "1"}, {}),
    ),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: serve's default model")
    p.add_argument(
        "--levers",
        default=None,
        help=f"of {', '.join(LEVERS)} (default: all; `tree` alone with --baseline-tree)",
    )
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=1, help="A/B pairs per lever, alternating")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--attention-crossover", action="store_true", help="see above")
    p.add_argument("--decode-attention", action="store_true", help="see above")
    p.add_argument("--baseline-tree", default=None, help="see above (lever `tree`)")
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # child: one config
    return p.parse_args()


def read_bandwidth_gbs() -> float:
    import torch

    data = torch.ones(128 << 20)  # 512 MiB of float32
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def measure(args: argparse.Namespace, settings: dict) -> dict:
    """In the child: prefill every prompt, then time the all-decoding steps."""
    from serve import LLM, SamplingParams

    results = {}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        llm = LLM(
            model=args.model,
            max_num_seqs=batch,
            enable_prefix_caching=False,
            async_scheduling=False,
            **settings,
        )
        vocab = llm.get_tokenizer().vocab_size
        rng = random.Random(0)
        # Long enough that the first prompts still decode when the last one is prefilled.
        params = SamplingParams(temperature=0.0, max_tokens=1024, ignore_eos=True)
        for i in range(batch):
            prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
            llm.add_request(f"r{i}", prompt, params)
        scheduler = llm.engine.scheduler
        start = time.perf_counter()
        while not (
            len(scheduler.running) == batch
            and all(
                s.num_computed_tokens >= args.prompt_len for g in scheduler.running for s in g.seqs
            )
        ):
            llm.step()
        prefill_s = time.perf_counter() - start
        steps = []
        for _ in range(args.decode_steps):
            start = time.perf_counter()
            llm.step()
            steps.append(time.perf_counter() - start)
        for i in range(batch):
            llm.abort_request(f"r{i}")
        step_s = statistics.median(steps[3:])
        model = llm.engine.executor.worker.model_runner.model  # the uniproc executor's
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        results[batch] = {
            "step_ms": 1000 * step_s,
            "decode_tok_s": batch / step_s,
            "prefill_tok_s": batch * args.prompt_len / prefill_s,
            "weight_bytes": weights,
        }
        del llm
    return results


def call_times_s(fn, *fn_args, repeats: int = 10) -> list[float]:
    """Seconds each of `repeats` calls of `fn(*fn_args)` took, after one warm-up call."""
    fn(*fn_args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*fn_args)
        times.append(time.perf_counter() - start)
    return times


def attention_crossover() -> None:
    import torch

    from serve.kernels import reference
    from serve.kernels.cpu import native
    from serve.kernels.metadata import AttentionMetadata

    if not native.available():
        sys.exit("the native CPU kernels are not built here")

    num_seqs, block_size, gen = 8, 16, torch.Generator().manual_seed(0)
    print(f"{'context':>7} {'queries':>7} {'native ms':>10} {'gather+fused ms':>16} {'ratio':>6}")
    for context in (256, 1024):
        for queries in (1, 2, 3, 4, 8, 16, 32, 64, 128):
            per_seq = -(-context // block_size)
            num_blocks = num_seqs * per_seq + 1
            shape = (3, num_blocks, block_size, 64)  # heads-first, as the CPU cache stores it
            k_cache = torch.randn(shape, generator=gen).permute(1, 2, 0, 3)
            v_cache = torch.randn(shape, generator=gen).permute(1, 2, 0, 3)
            tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * per_seq]
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(num_seqs * queries, dtype=torch.long),
                block_tables=tables.view(num_seqs, per_seq),
                seq_lens=torch.full((num_seqs,), context),
                query_start_loc=torch.arange(num_seqs + 1) * queries,
                seq_lens_cpu=[context] * num_seqs,
                query_lens_cpu=[queries] * num_seqs,
                num_decode_seqs=num_seqs if queries == 1 else 0,
            )
            query = torch.randn(num_seqs * queries, 9, 64, generator=gen)
            out = torch.empty_like(query)
            args = (meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, None, 0, 0.0)
            native_ms = 1000 * min(
                call_times_s(
                    torch.ops.serve_cpu.paged_attention, out, query, k_cache, v_cache, *args
                )
            )
            torch_ms = 1000 * min(
                call_times_s(
                    reference.attend_chunks,
                    out,
                    query,
                    k_cache,
                    v_cache,
                    meta,
                    range(num_seqs),
                    0.125,
                )
            )
            print(
                f"{context:7d} {queries:7d} {native_ms:10.2f} {torch_ms:16.2f} "
                f"{native_ms / torch_ms:5.2f}x"
            )


def decode_attention() -> None:
    import torch

    from serve.kernels.cpu import native

    if not native.available():
        sys.exit("the native CPU kernels are not built here")
    num_seqs, context, layers, block_size = 64, 400, 30, 16
    num_blocks = 5825  # a 4 GiB cache of the default model: 737 KB a block over 30 layers
    per_seq = -(-context // block_size)
    gap = num_blocks // num_seqs
    gen = torch.Generator().manual_seed(0)
    caches = [  # heads-first, as the CPU cache stores it
        tuple(
            torch.randn(3, num_blocks, block_size, 64, generator=gen).permute(1, 2, 0, 3)
            for _ in range(2)
        )
        for _ in range(layers)
    ]
    tables = torch.stack([torch.arange(i * gap, i * gap + per_seq) for i in range(num_seqs)])
    seq_lens = context - torch.randint(0, block_size, (num_seqs,), generator=gen)
    starts = torch.arange(num_seqs + 1)
    query = torch.randn(num_seqs, 9, 64, generator=gen)
    out = torch.empty_like(query)
    kv_bytes = int(seq_lens.sum()) * 3 * 64 * 4 * 2 * layers

    def step() -> None:
        for k_cache, v_cache in caches:
            torch.ops.serve_cpu.paged_attention(
                out, query, k_cache, v_cache, tables, seq_lens, starts, 0.125, None, 0, 0.0
            )

    threads = torch.get_num_threads()
    print(f"decode attention, {num_seqs} sequences x ~{context} keys, {layers} layers:")
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        times = call_times_s(step, repeats=15)
        best, median = min(times), statistics.median(times)
        print(
            f"  {n} thread(s): median {1000 * median:.1f} ms, best {1000 * best:.1f} ms "
            f"({kv_bytes / best / 1e9:.1f} GB/s of K/V); "
            f"plain sum {read_bandwidth_gbs():.1f} GB/s"
        )
    torch.set_num_threads(threads)


def run_config(args: argparse.Namespace, env: dict, settings: dict) -> dict:
    cmd = [sys.executable, __file__, "--measure", json.dumps(settings)]
    cmd += ["--batch-sizes", args.batch_sizes, "--prompt-len", str(args.prompt_len)]
    cmd += ["--decode-steps", str(args.decode_steps)]
    cmd += ["--model", args.model] if args.model else []
    done = subprocess.run(
        cmd, env={**os.environ, **env}, capture_output=True, text=True, check=False
    )
    if done.returncode:
        sys.exit(done.stderr[-4000:])
    return {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}


def main() -> None:
    args = parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args, json.loads(args.measure))))
        return
    if args.attention_crossover:
        attention_crossover()
        return
    if args.decode_attention:
        decode_attention()
        return
    levers = dict(LEVERS)
    if args.baseline_tree:
        tree = str(Path(args.baseline_tree).resolve())
        levers["tree"] = (("base", {"PYTHONPATH": tree}, {}), ("this", {}, {}))
    chosen = args.levers or ("tree" if args.baseline_tree else ",".join(LEVERS))
    unknown = [lever for lever in chosen.split(",") if lever not in levers]
    if unknown:
        sys.exit(
            f"unknown lever(s) {', '.join(unknown)}: of {', '.join(levers)}"
            + ("" if args.baseline_tree else " (`tree` needs --baseline-tree)")
        )
    bandwidth = read_bandwidth_gbs()
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s (best of 5 sums over 512 MiB)")
    report = {"bandwidth_gbs": bandwidth, "levers": {}}
    for lever in chosen.split(","):
        (name_a, env_a, set_a), (name_b, env_b, set_b) = levers[lever]
        report["levers"][lever] = []
        for round_ in range(args.rounds):
            a, b = run_config(args, env_a, set_a), run_config(args, env_b, set_b)
            report["levers"][lever].append({name_a: a, name_b: b})
            label = f"{lever}: {name_a} -> {name_b}"
            print_pair(
                label if args.rounds == 1 else f"{label}, round {round_ + 1}",
                a,
                b,
                name_b,
                bandwidth,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def print_pair(label: str, a: dict, b: dict, name_b: str, bandwidth: float) -> None:
    print(f"\n{label}")
    print(f"{'batch':>5} {'step ms':>17} {'decode tok/s':>19} {'prefill tok/s':>19} {'ratio':>6}")
    for batch in a:
        ra, rb = a[batch], b[batch]
        print(
            f"{batch:5d} {ra['step_ms']:8.1f} {rb['step_ms']:8.1f} "
            f"{ra['decode_tok_s']:9.1f} {rb['decode_tok_s']:9.1f} "
            f"{ra['prefill_tok_s']:9.0f} {rb['prefill_tok_s']:9.0f} "
            f"{ra['step_ms'] / rb['step_ms']:5.2f}x"
        )
        if batch == 1:
            floor_ms = rb["weight_bytes"] / bandwidth / 1e6
            print(
                f"      batch-1 floor (weights {rb['weight_bytes'] / 1e6:.0f} MB / bandwidth): "
                f"{floor_ms:.1f} ms; {name_b} is {rb['step_ms'] / floor_ms:.2f}x the floor"
            )


if __name__ == "__main__":
    main()
