"""Forward throughput per model family: serve's model against HF transformers', side by side.

Each family of tests/model_families.py is built at a small-but-not-trivial size (hidden
512, 4 layers, 8 heads; the family's own fields kept) with random weights, and both models
run the same forwards in one process, float32 on the CPU:

- prefill: `--batch` sequences of `--prompt-len` tokens in one forward, logits of each
  sequence's last token (HF: a padded-free [batch, len] batch with `logits_to_keep=1`;
  serve: the flat token stream through its paged KV cache);
- decode: one new token for each of `--decode-batch` sequences whose `--context` tokens are
  cached (HF: its DynamicCache; serve: paged blocks), `--decode-steps` steps in a row.

Engine overhead (scheduling, sampling, detokenizing) is not in these numbers: that is
benchmarks/throughput.py's. Both run with glibc keeping freed memory for reuse, as serve's
CPU worker sets it. Ratios above 1 mean serve's forward is faster.

    python benchmarks/families.py                       # every family
    python benchmarks/families.py --families gpt2,bloom
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from model_families import FAMILIES, FAMILIES_BY_KEY  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from serve.config import ModelConfig  # noqa: E402
from serve.kernels import AttentionMetadata  # noqa: E402
from serve.kv_cache.cache_engine import CacheEngine  # noqa: E402
from serve.models.forward_context import forward_context  # noqa: E402
from serve.models.layers.attention import attention_layers  # noqa: E402
from serve.models.loader import load_hf_config, load_model  # noqa: E402
from serve.worker.cpu_malloc import keep_freed_memory  # noqa: E402

# The benchmark size, over the tiny test shape; a family's own fields stay unless named here.
SIZE = {
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 1408,
    "max_position_embeddings": 1024,
}
BLOCK_SIZE = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=None, help="comma-separated keys; default: all")
    p.add_argument("--batch", type=int, default=4, help="prefill: sequences")
    p.add_argument("--prompt-len", type=int, default=128, help="prefill: tokens each")
    p.add_argument("--decode-batch", type=int, default=16, help="decode: sequences")
    p.add_argument("--context", type=int, default=256, help="decode: cached tokens each")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7, help="timed runs after a warm-up; best")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


# Widths by each family's own name, set to the benchmark's MLP (and expert) width.
WIDTH_FIELDS = (
    "n_inner",
    "ffn_dim",
    "ffn_hidden_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def _size_for(family) -> dict:
    """SIZE over the family's tiny test shape: the hidden size, layers, heads and widths
    always (whatever the family spells them), its head layout (MQA, KV groups) kept."""
    size = {k: v for k, v in SIZE.items() if k not in family.drop}
    for name in WIDTH_FIELDS:
        if name in family.config:
            size[name] = SIZE["intermediate_size"]
    if "num_key_value_heads" in family.config or "multi_query" in family.config:
        size.pop("num_key_value_heads", None)
    if "head_dim" in family.config:  # a family testing its own head_dim keeps the ratio
        size["head_dim"] = SIZE["hidden_size"] // SIZE["num_attention_heads"]
    if "kv_lora_rank" in family.config:  # DeepSeek's MLA, in V2-Lite's proportions to hidden
        size.update(kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
        if family.config.get("q_lora_rank"):
            size["q_lora_rank"] = 96
    layer_types = family.config.get("layer_types")
    if layer_types:  # the family's pattern, repeated over the benchmark's layers
        layers = SIZE["num_hidden_layers"]
        size["layer_types"] = [layer_types[i % len(layer_types)] for i in range(layers)]
    rope = family.config.get("rope_parameters")
    if rope and "short_factor" in rope:  # LongRoPE: one factor per rotated pair of channels
        pairs = SIZE["hidden_size"] // SIZE["num_attention_heads"] // 2
        stretch = pairs // len(rope["short_factor"])
        size["rope_parameters"] = rope | {
            name: [f for f in rope[name] for _ in range(stretch)]
            for name in ("short_factor", "long_factor")
        }
    return size


class ServeRunner:
    """serve's model with a paged KV cache of its own: sequence b's blocks are contiguous."""

    def __init__(self, model_dir: Path, num_seqs: int, max_len: int) -> None:
        hf_config = load_hf_config(model_dir)
        self.model = load_model(
            ModelConfig(dtype="float32"), model_dir, hf_config, torch.device("cpu")
        )
        attn = attention_layers(self.model)
        self.blocks_per_seq = -(-max_len // BLOCK_SIZE)
        cache = CacheEngine(
            len(attn),
            num_seqs * self.blocks_per_seq,
            BLOCK_SIZE,
            attn[0].num_kv_heads,
            attn[0].head_dim,
            torch.float32,
            torch.device("cpu"),
            shared_kv=attn[0].shared_kv,
        )
        for layer, kv_cache in zip(attn, cache.kv_caches):
            layer.kv_cache = kv_cache
        self.tables = torch.arange(num_seqs * self.blocks_per_seq).view(num_seqs, -1)

    def forward(self, token_ids: torch.Tensor, start: int) -> torch.Tensor:
        """Positions [start, start + n) of every sequence: token_ids [num_seqs, n] -> the
        logits of each sequence's last token."""
        num_seqs, n = token_ids.shape
        positions = torch.arange(start, start + n).repeat(num_seqs)  # [num_seqs * n]
        seq = torch.arange(num_seqs).repeat_interleave(n)
        slots = self.tables[seq, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.tables,
            seq_lens=torch.full((num_seqs,), start + n),
            query_start_loc=torch.arange(0, num_seqs * n + 1, n),
            seq_lens_cpu=[start + n] * num_seqs,
            query_lens_cpu=[n] * num_seqs,
            num_decode_seqs=num_seqs if n == 1 else 0,
        )
        with torch.inference_mode(), forward_context(meta):
            hidden = self.model(token_ids.flatten(), positions)  # [num_seqs * n, hidden]
        last = torch.arange(n - 1, num_seqs * n, n)
        with torch.inference_mode():
            return self.model.compute_logits(hidden[last])


def bench_family(key: str, args: argparse.Namespace, work_dir: Path) -> dict:
    timings: list[float] = []  # the decode loops' times, read after each call
    import transformers
    from transformers import DynamicCache

    family = FAMILIES_BY_KEY[key]
    model_dir = make_tiny_model(key, work_dir / key, check_degenerate=False, **_size_for(family))
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 512, (args.batch, args.prompt_len), generator=gen)
    contexts = torch.randint(3, 512, (args.decode_batch, args.context), generator=gen)
    steps = torch.randint(3, 512, (args.decode_batch, args.decode_steps), generator=gen)

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def hf_prefill() -> None:
        with torch.inference_mode():
            hf(prompts, logits_to_keep=1)

    def hf_decode() -> None:
        with torch.inference_mode():
            cache = DynamicCache(config=hf.config)
            hf(contexts, past_key_values=cache, use_cache=True, logits_to_keep=1)
            start = time.perf_counter()
            for i in range(args.decode_steps):
                hf(steps[:, i : i + 1], past_key_values=cache, use_cache=True)
            timings.append(time.perf_counter() - start)

    max_len = max(args.prompt_len, args.context + args.decode_steps)
    num_seqs = max(args.batch, args.decode_batch)
    runner = ServeRunner(model_dir, num_seqs, max_len)

    def serve_prefill() -> None:
        runner.forward(prompts, 0)

    def serve_decode() -> None:
        runner.forward(contexts, 0)
        start = time.perf_counter()
        for i in range(args.decode_steps):
            runner.forward(steps[:, i : i + 1], args.context + i)
        timings.append(time.perf_counter() - start)

    results = {"family": key, "architecture": family.architecture}
    num_prefill = args.batch * args.prompt_len
    num_decode = args.decode_batch * args.decode_steps
    # HF and serve take turns, so a slow spell of the machine hits both alike.
    best = {name: float("inf") for name in ("hf_prefill", "serve_prefill")}
    hf_prefill(), serve_prefill()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("hf_prefill", hf_prefill), ("serve_prefill", serve_prefill)):
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    decode_times: dict[str, list[float]] = {"hf": [], "serve": []}
    hf_decode(), serve_decode()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("hf", hf_decode), ("serve", serve_decode)):
            timings.clear()
            fn()
            decode_times[name].append(timings[0])
    for name in ("hf", "serve"):
        results[f"{name}_prefill_tokens_per_s"] = num_prefill / best[f"{name}_prefill"]
        results[f"{name}_decode_tokens_per_s"] = num_decode / min(decode_times[name])
    for phase in ("prefill", "decode"):
        results[f"{phase}_ratio"] = (
            results[f"serve_{phase}_tokens_per_s"] / results[f"hf_{phase}_tokens_per_s"]
        )
    return results


def main() -> None:
    args = parse_args()
    # As serve's CPU worker runs (worker.py); HF shares the process, so it gains the same.
    keep_freed_memory()
    keys = args.families.split(",") if args.families else [f.key for f in FAMILIES]
    unknown = sorted(set(keys) - set(FAMILIES_BY_KEY))
    if unknown:
        raise SystemExit(f"unknown families: {unknown}; known: {sorted(FAMILIES_BY_KEY)}")
    print(
        f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"float32; prefill {args.batch} x {args.prompt_len} tokens; decode {args.decode_batch} "
        f"sequences at {args.context} cached tokens, {args.decode_steps} steps; best of "
        f"{args.repeats} after a warm-up",
        flush=True,
    )
    header = f"{'family':<24} {'prefill tok/s HF':>16} {'serve':>8} {'ratio':>6}"
    print(header + f" {'decode tok/s HF':>16} {'serve':>8} {'ratio':>6}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for key in keys:
            r = bench_family(key, args, Path(tmp))
            results.append(r)
            print(
                f"{key:<24} {r['hf_prefill_tokens_per_s']:>16.0f} "
                f"{r['serve_prefill_tokens_per_s']:>8.0f} {r['prefill_ratio']:>5.2f}x "
                f"{r['hf_decode_tokens_per_s']:>16.0f} {r['serve_decode_tokens_per_s']:>8.0f} "
                f"{r['decode_ratio']:>5.2f}x",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
