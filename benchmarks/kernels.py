"""Paged attention kernels against the GPU's measured limits and torch's SDPA.

Decode (Llama-3-8B heads: 32 query heads, 8 KV heads, head 128, bfloat16, block 16, shuffled
block tables): time, achieved bandwidth = (K/V bytes read + q and out bytes) / time, as a
fraction of the device's measured copy bandwidth; the baseline is torch SDPA on K/V first
gathered into contiguous tensors, with the gather timed separately.

Prefill (one sequence of N tokens, causal): TFLOP/s of the paged kernel against torch SDPA's
flash backend on the same data laid out contiguously, and against the measured bf16 matmul
rate. Both count the causal half: 2 * N^2 * num_heads * head_dim FLOPs.

    python benchmarks/kernels.py                  # on a CUDA GPU; record in RESULTS.md
    python benchmarks/kernels.py --smoke          # tiny shapes, CPU interpreter: checks it runs
    python benchmarks/kernels.py --sliding-window 4096   # decode with Mistral's window

Goals: decode >= 70% of copy bandwidth at batch >= 16 and context >= 2k; paged prefill >=
0.8x SDPA flash.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():  # --smoke: Triton reads this when the kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from serve.kernels.metadata import AttentionMetadata  # noqa: E402
from serve.kernels.triton import paged_attention  # noqa: E402
from serve.kernels.triton.decode_attention import (  # noqa: E402
    choose_num_splits,
    decode_attention,
)
from serve.kernels.triton.runtime import num_sms  # noqa: E402


@dataclass(frozen=True)
class Shape:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


@dataclass
class DecodeRow:
    batch: int
    context: int
    num_splits: int
    triton_us: float
    triton_bw_frac: float
    sdpa_us: float
    sdpa_bw_frac: float
    gather_us: float


@dataclass
class PrefillRow:
    tokens: int
    triton_us: float
    triton_tflops: float
    sdpa_flash_us: float
    sdpa_tflops: float
    vs_sdpa: float
    vs_matmul: float


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU (interpreter)")
    p.add_argument("--batches", default="1,16,64,256", help="decode batch sizes")
    p.add_argument("--contexts", default="512,2048,8192", help="decode context lengths")
    p.add_argument("--prefill-tokens", default="512,2048,8192", help="prefill lengths")
    p.add_argument("--decode-splits", type=int, default=None, help="force flash-decoding splits")
    p.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="decode with this window: bandwidth counts the keys it reads, SDPA gets only those",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args()


def bench_us(fn: Callable[[], object], device: torch.device) -> float:
    """Median microseconds per call: triton's do_bench on a GPU (L2 flushed between calls),
    a few wall-clock runs on the CPU interpreter."""
    if device.type == "cuda":
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * sorted(times)[1]


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes/s of a device-to-device copy (bytes read + bytes written)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / (bench_us(lambda: dst.copy_(src), device) * 1e-6)


def matmul_flops(device: torch.device, n: int, dtype: torch.dtype) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / (bench_us(lambda: a @ b, device) * 1e-6)


def paged_batch(
    seq_lens: list[int], query_lens: list[int], shape: Shape, dtype, device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random caches holding exactly these contexts, blocks shuffled; all decodes or all
    prefills. Returns (query, key_cache, value_cache, meta)."""
    gen = torch.Generator(device).manual_seed(seed)
    bs = shape.block_size
    blocks_per_seq = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(blocks_per_seq)
    pool = torch.randperm(num_blocks, generator=gen, device=device)
    max_blocks = max(blocks_per_seq)
    tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.long, device=device)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = pool[start : start + n]
        start += n
    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    query = torch.randn(
        sum(query_lens), shape.num_heads, shape.head_dim, generator=gen, device=device
    )
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.full((sum(query_lens),), -1, dtype=torch.long, device=device),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, device=device),
        query_start_loc=torch.tensor(query_start_loc, device=device),
        seq_lens_cpu=list(seq_lens),
        query_lens_cpu=list(query_lens),
        num_decode_seqs=len(seq_lens) if max(query_lens) == 1 else 0,
    )
    return query.to(dtype), key_cache, value_cache, meta


def gather_contiguous(cache: torch.Tensor, tables: torch.Tensor, context: int) -> torch.Tensor:
    """[batch, num_kv_heads, context, head_dim] from a paged cache: SDPA's layout."""
    batch = tables.shape[0]
    blocks = cache.index_select(0, tables.flatten())  # [batch * blocks, bs, kv_heads, D]
    seqs = blocks.view(batch, -1, cache.shape[2], cache.shape[3])[:, :context]
    return seqs.transpose(1, 2).contiguous()


def bench_decode(batch: int, context: int, shape: Shape, args, device, copy_bw: float) -> DecodeRow:
    dtype = torch.bfloat16
    query, key_cache, value_cache, meta = paged_batch(
        [context] * batch, [1] * batch, shape, dtype, device, seed=batch * context
    )
    tables = meta.block_tables
    scale = shape.head_dim**-0.5
    window = args.sliding_window
    num_keys = min(context, window or context)  # the keys each query reads
    splits = args.decode_splits or choose_num_splits(
        batch, shape.num_kv_heads, num_keys, num_sms(device)
    )

    def run_triton():
        return decode_attention(
            query,
            key_cache,
            value_cache,
            tables,
            meta.seq_lens,
            context,
            scale,
            num_splits=splits,
            sliding_window=window,
        )

    triton_us = bench_us(run_triton, device)
    gather_us = bench_us(lambda: gather_contiguous(key_cache, tables, context), device)
    k = gather_contiguous(key_cache, tables, context)[:, :, context - num_keys :]
    v = gather_contiguous(value_cache, tables, context)[:, :, context - num_keys :]
    q = query.view(batch, shape.num_heads, 1, shape.head_dim)
    sdpa_us = bench_us(
        lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True), device
    )

    element = query.element_size()
    kv_bytes = 2 * batch * num_keys * shape.num_kv_heads * shape.head_dim * element
    qo_bytes = 2 * batch * shape.num_heads * shape.head_dim * element
    moved = kv_bytes + qo_bytes
    return DecodeRow(
        batch=batch,
        context=context,
        num_splits=splits,
        triton_us=triton_us,
        triton_bw_frac=moved / (triton_us * 1e-6) / copy_bw,
        sdpa_us=sdpa_us,
        sdpa_bw_frac=moved / (sdpa_us * 1e-6) / copy_bw,
        gather_us=gather_us,
    )


def bench_prefill(tokens: int, shape: Shape, device, matmul_rate: float) -> PrefillRow:
    dtype = torch.bfloat16
    query, key_cache, value_cache, meta = paged_batch(
        [tokens], [tokens], shape, dtype, device, seed=tokens
    )
    tables = meta.block_tables
    scale = shape.head_dim**-0.5
    triton_us = bench_us(
        lambda: paged_attention(query, key_cache, value_cache, meta, scale), device
    )

    group = shape.num_heads // shape.num_kv_heads
    q = query.transpose(0, 1).unsqueeze(0).contiguous()  # [1, num_heads, tokens, D]
    k = gather_contiguous(key_cache, tables, tokens).repeat_interleave(group, dim=1)
    v = gather_contiguous(value_cache, tables, tokens).repeat_interleave(group, dim=1)

    def run_sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run_flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return run_sdpa()

        sdpa_us = bench_us(run_flash, device)
    else:
        sdpa_us = bench_us(run_sdpa, device)

    flops = 2 * tokens**2 * shape.num_heads * shape.head_dim  # causal: half of 4 * N^2 * H * D
    triton_tflops = flops / (triton_us * 1e-6) / 1e12
    return PrefillRow(
        tokens=tokens,
        triton_us=triton_us,
        triton_tflops=triton_tflops,
        sdpa_flash_us=sdpa_us,
        sdpa_tflops=flops / (sdpa_us * 1e-6) / 1e12,
        vs_sdpa=sdpa_us / triton_us,
        vs_matmul=triton_tflops * 1e12 / matmul_rate,
    )


def print_table(header: list[str], rows: list[list]) -> None:
    """A markdown table, ready to paste into RESULTS.md."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("No CUDA GPU: pass --smoke to check the script on CPU (interpreter).")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    if args.smoke:
        shape = Shape(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
        batches, contexts, prefill_tokens = [1, 2], [64], [32]
        copy_bytes, matmul_n = 1 << 20, 128
    else:
        shape = Shape()
        batches, contexts = ints(args.batches), ints(args.contexts)
        prefill_tokens, copy_bytes, matmul_n = ints(args.prefill_tokens), 1 << 30, 8192

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    copy_bw = copy_bandwidth(device, copy_bytes)
    matmul_rate = matmul_flops(device, matmul_n, torch.bfloat16)
    print(f"{datetime.date.today()} · {name} · torch {torch.__version__}")
    print(f"measured copy bandwidth {copy_bw / 1e9:.0f} GB/s, ", end="")
    print(f"bf16 matmul {matmul_rate / 1e12:.0f} TFLOP/s")
    print(f"heads {shape.num_heads}q/{shape.num_kv_heads}kv, head_dim {shape.head_dim}, ", end="")
    print(f"block {shape.block_size}, bfloat16", end="")
    print(f", decode sliding window {args.sliding_window}\n" if args.sliding_window else "\n")

    decode_rows = [
        bench_decode(b, c, shape, args, device, copy_bw) for b in batches for c in contexts
    ]
    print_table(
        ["batch", "context", "splits", "triton us", "triton BW", "SDPA us", "SDPA BW", "gather us"],
        [
            [r.batch, r.context, r.num_splits, f"{r.triton_us:.1f}", f"{r.triton_bw_frac:.0%}",
             f"{r.sdpa_us:.1f}", f"{r.sdpa_bw_frac:.0%}", f"{r.gather_us:.1f}"]
            for r in decode_rows
        ],
    )  # fmt: skip

    prefill_rows = [bench_prefill(n, shape, device, matmul_rate) for n in prefill_tokens]
    print()
    print_table(
        ["tokens", "triton us", "TFLOP/s", "SDPA flash us", "TFLOP/s", "triton / SDPA", "of matmul"],
        [
            [r.tokens, f"{r.triton_us:.1f}", f"{r.triton_tflops:.1f}", f"{r.sdpa_flash_us:.1f}",
             f"{r.sdpa_tflops:.1f}", f"{r.vs_sdpa:.2f}x", f"{r.vs_matmul:.0%}"]
            for r in prefill_rows
        ],
    )  # fmt: skip

    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "date": str(datetime.date.today()),
                    "device": name,
                    "copy_bandwidth_bytes_per_s": copy_bw,
                    "bf16_matmul_flops": matmul_rate,
                    "shape": asdict(shape),
                    "decode": [asdict(r) for r in decode_rows],
                    "prefill": [asdict(r) for r in prefill_rows],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
