"""Quantized linear layers on CPU: serve's native kernel (serve/kernels/cpu/csrc/
quantized_linear.cpp, through `serve.kernels.cpu.quantized_linear`) against the float32
linear (`serve.kernels.cpu.linear`: the native kernel for a row or two, oneDNN on a
prepacked weight above) and the torch reference (the whole weight dequantized per call).

    python benchmarks/quantized_linear.py                       # the table for RESULTS.md
    python benchmarks/quantized_linear.py --rows 1 4 --layers 7b-qkv
    python benchmarks/quantized_linear.py --dtype bfloat16 --no-reference
    python benchmarks/quantized_linear.py --act-order --layers smollm2-qkv --rows 1 4 16
    python benchmarks/quantized_linear.py --march x86-64-v3 --kinds uint4 "uint4 g32" fp4

Layers (out x in): the default model's (SmolLM2-135M: hidden 576, intermediate 1536; q/k/v
fused, 576 + 192 + 192 = 960 outputs; gate/up fused, 2 x 1536) and a Llama-7B-sized
layer's (4096 x 4096, 11008 x 4096). Weights: uint4 and uint8 in groups of 128 inputs with
zero points (GPTQ's), fp8 with a scale per output (FP8 checkpoints'), fp4 E2M1 in groups
of 32 with power-of-two scales and no zero points (MXFP4, GPT-OSS's experts'). Each call
reads the next of enough copies of its weight to fill 128 MiB, more than the L3 holds, so
the weights come from memory as a model's layers do, not from cache. `--act-order` adds GPTQ
act order's uint4 (each group's inputs scattered over the row) twice: as the checkpoint
holds it (`uint4 g_idx`: each input's group looked up) and as serve loads it where its
groups are whole (`uint4 sorted`: inputs sorted by group, x's columns gathered per call).
`--kinds` picks the columns; `uint4 g32` is uint4 in groups of 32 inputs. `--march` measures
the kernels built for another target (`SERVE_CPU_KERNELS_MARCH`, native.py): `x86-64-v3`,
AVX2 without AVX-512, the Docker images' and the CI machine's, on an AVX-512 machine.

For each layer and row count: the median time of each op, its calls interleaved (one call
of each in turn), so a shared machine's drift falls on all of them alike; the reference's
median of a few calls apart, as it is slow.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from serve.kernels import cpu, reference
from serve.kernels.cpu import native
from serve.kernels.packed_weight import PackedWeight, mxfp4_weight, pack_uint4, sort_inputs_by_group

LAYERS = {  # name: (out_features, in_features)
    "smollm2-qkv": (960, 576),
    "smollm2-o": (576, 576),
    "smollm2-gate-up": (3072, 576),
    "smollm2-down": (576, 1536),
    "7b-qkv": (4096, 4096),
    "7b-gate": (11008, 4096),
}
QUANTIZED = ("uint4", "uint8", "fp8", "fp4")  # the default columns
GROUPS_OF_32 = "uint4 g32"
ACT_ORDER = ("uint4 g_idx", "uint4 sorted")  # --act-order's
CYCLE_BYTES = 128 << 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", choices=LAYERS, default=list(LAYERS))
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 256])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--no-reference", action="store_true", help="skip the torch reference")
    p.add_argument("--seconds", type=float, default=1.0, help="time per (layer, rows)")
    p.add_argument("--act-order", action="store_true", help="add act order's uint4, both ways")
    p.add_argument("--kinds", nargs="+", choices=(*QUANTIZED, GROUPS_OF_32), default=QUANTIZED)
    p.add_argument(
        "--march",
        help=f"build the kernels for this -march ({native.MARCH_ENV_VAR}), e.g. x86-64-v3",
    )
    return p.parse_args()


def float_weight(out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(out_features, in_features).to(dtype)


def packed_weight(kind: str, out_features: int, in_features: int) -> PackedWeight:
    if kind in ACT_ORDER:
        weight = packed_weight("uint4", out_features, in_features)
        perm = torch.randperm(in_features)
        weight = replace(weight, g_idx=(torch.arange(in_features) // 128)[perm])
        return weight if kind == "uint4 g_idx" else sort_inputs_by_group(weight)
    shape = (out_features, in_features)
    if kind == "fp4":
        blocks = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8)
        scales = torch.randint(120, 131, (out_features, in_features // 32), dtype=torch.uint8)
        return mxfp4_weight(blocks, scales)
    if kind == "fp8":
        codes = (torch.randn(shape) * 64).to(torch.float8_e4m3fn)
        scales = 0.01 + 0.09 * torch.rand(out_features, 1)
        return PackedWeight("fp8", codes, scales, None, in_features, in_features)
    group_size = 32 if kind == GROUPS_OF_32 else 128
    kind = kind.split()[0]
    levels = 16 if kind == "uint4" else 256
    codes = torch.randint(0, levels, shape, dtype=torch.uint8)
    if kind == "uint4":
        codes = pack_uint4(codes)
    groups = (out_features, -(-in_features // group_size))
    scales = 0.01 + 0.09 * torch.rand(groups)
    zeros = torch.rand(groups) * (levels - 1)
    return PackedWeight(kind, codes, scales, zeros, group_size, in_features)


def weight_bytes(weight: torch.Tensor | PackedWeight) -> int:
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    parts = (weight.codes, weight.scales, weight.zeros)
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def copies(make: Callable[[], torch.Tensor | PackedWeight]) -> list:
    first = make()
    count = max(1, -(-CYCLE_BYTES // weight_bytes(first)))
    return [first] + [make() for _ in range(count - 1)]


def interleaved_medians(
    ops: dict[str, Callable[[int], object]], num_copies: int, seconds: float
) -> dict[str, float]:
    """Median ms of each op, called in turn; op(i) runs on the i-th weight copy."""
    for op in ops.values():  # warm-up: oneDNN reorders each copy on first use
        for i in range(num_copies):
            op(i)
    start = time.perf_counter()
    times = {name: [] for name in ops}
    i = 0
    while i < 5 or (time.perf_counter() - start < seconds and i < 2000):
        for name, op in ops.items():
            t = time.perf_counter()
            op(i)
            times[name].append(time.perf_counter() - t)
        i += 1
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def reference_median(x: torch.Tensor, weight: PackedWeight) -> float:
    reference.quantized_linear(x, weight)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        reference.quantized_linear(x, weight)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def measure_layer(name: str, args: argparse.Namespace, dtype: torch.dtype) -> None:
    """Prints the layer's row of the table for each row count."""
    out_features, in_features = LAYERS[name]
    floats = copies(partial(float_weight, out_features, in_features, dtype))
    kinds = tuple(args.kinds) + (ACT_ORDER if args.act_order else ())
    packed = {
        kind: copies(partial(packed_weight, kind, out_features, in_features)) for kind in kinds
    }
    num_copies = max(len(floats), *(len(w) for w in packed.values()))
    for rows in args.rows:
        x = torch.randn(rows, in_features).to(dtype)

        def run_float(i: int, x: torch.Tensor = x) -> torch.Tensor:
            return cpu.linear(x, floats[i % len(floats)])

        def run_packed(i: int, kind: str, x: torch.Tensor = x) -> torch.Tensor:
            return cpu.quantized_linear(x, packed[kind][i % len(packed[kind])])

        ops = {"float": run_float} | {kind: partial(run_packed, kind=kind) for kind in kinds}
        with torch.inference_mode():
            ms = interleaved_medians(ops, num_copies, args.seconds)
            ref = None if args.no_reference else reference_median(x, packed[kinds[0]][0])
        cells = [f"{name} ({out_features}x{in_features})", str(rows), f"{ms['float']:.3f}"]
        cells += [f"{ms[kind]:.3f}" for kind in kinds]
        cells.append("-" if ref is None else f"{ref:.3f}")
        cells.append(f"{ms['float'] / ms[kinds[0]]:.2f}x")
        print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    if args.march:  # read by native.available(), below, before anything has loaded a build
        os.environ[native.MARCH_ENV_VAR] = args.march
    if not native.available():
        raise SystemExit("the native CPU kernels are unavailable here; nothing to measure")
    print(
        f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"x {args.dtype}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"kernels -march={native.march()}"
    )
    header = ["layer (out x in)", "rows", f"{args.dtype} linear", *args.kinds]
    header += ACT_ORDER if args.act_order else ()
    header += [f"reference {args.kinds[0]}", f"{args.kinds[0]} speed-up"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    torch.manual_seed(0)
    for name in args.layers:
        measure_layer(name, args, dtype)


if __name__ == "__main__":
    main()
