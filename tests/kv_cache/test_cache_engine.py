"""The CPU swap space: gigabytes mapped at start that stay untouched until preemption
swaps into them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serve.config import physical_memory_bytes
from serve.kv_cache.cache_engine import CacheEngine

OVERCOMMIT = Path("/proc/sys/vm/overcommit_memory")


@pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or not OVERCOMMIT.exists()
    or OVERCOMMIT.read_text().strip() != "0",
    reason="Linux's default overcommit heuristic (mode 0) is what refuses the fork",
)
def test_untouched_swap_space_larger_than_ram_leaves_the_process_able_to_fork():
    """Under the heuristic, a private mapping larger than RAM + swap is refused, and so is
    any fork of a process holding one: a swap space mapped as plain memory made Ray's
    worker start-up (a fork, for its preexec_fn) fail with ENOMEM."""
    ram = physical_memory_bytes()
    assert ram
    block_bytes = 16 * 4 * 64 * 4  # block_size x kv heads x head_dim x float32
    num_cpu_blocks = 2 * ram // block_bytes  # per tensor: twice the machine's RAM
    cache = CacheEngine(1, 2, 16, 4, 64, torch.float32, torch.device("cpu"), num_cpu_blocks)
    key_swap, value_swap = cache.swap_caches[0]
    assert key_swap.numel() * 4 > ram and value_swap.shape == key_swap.shape

    done = subprocess.run([sys.executable, "-c", "pass"], preexec_fn=lambda: None, timeout=60)
    assert done.returncode == 0

    # the mapping is ordinary memory where it is written
    key_swap[num_cpu_blocks - 1] = 1.5
    value_swap[0] = -2.0
    assert key_swap[num_cpu_blocks - 1].sum().item() == 1.5 * block_bytes / 4
    assert value_swap[0].sum().item() == -2.0 * block_bytes / 4
