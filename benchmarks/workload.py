"""The seeded synthetic workload shared by the offline and the serving benchmarks.

Each request is a prompt of random token ids and a fixed output length (the engine is told
to ignore EOS), so every engine does the same useful work. The same seed, ranges and token
ids give the same requests in `throughput.py`, `serving_compare.py` and `serve bench`'s
random dataset (serve/bench/datasets.py, which draws them).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from serve.bench.datasets import Request, random_requests

__all__ = ["Request", "WorkloadSpec", "add_workload_args", "make_requests"]


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    min_prompt: int  # prompt and output lengths are drawn uniformly from [min, max]
    max_prompt: int
    min_output: int
    max_output: int
    seed: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkloadSpec:
        names = ("num_requests", "min_prompt", "max_prompt", "min_output", "max_output", "seed")
        return cls(**{name: getattr(args, name) for name in names})


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)


def ordinary_token_ids(tokenizer) -> list[int]:
    """The vocabulary's ids less the special and added tokens: what random prompts draw."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return [i for i in range(len(tokenizer)) if i not in special]


def make_requests(spec: WorkloadSpec, token_ids: Sequence[int]) -> list[Request]:
    """`token_ids`: the ids prompts draw from, in ascending order (no special tokens)."""
    return random_requests(
        spec.num_requests,
        (spec.min_prompt, spec.max_prompt),
        (spec.min_output, spec.max_output),
        token_ids,
        spec.seed,
    )
