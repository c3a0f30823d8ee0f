"""On Linux with glibc, the CPU engine keeps freed activations in the heap for reuse: after
`keep_freed_memory`, freeing large blocks leaves the process at its peak RSS and allocating
them again costs no page faults, where glibc's defaults hand the pages back each time.

Each measurement runs in a fresh interpreter, so the test process's heap settings are
untouched and every run starts from glibc's defaults."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import serve
from serve.worker.cpu_malloc import MMAP_THRESHOLD_MAX

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc's mallopt only",
)

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20

# Each round allocates `num_blocks` blocks of `block_bytes`, writes every page (bytearray
# zero-fills), frees them all, and reports RSS at the peak and after the free, and the
# minor page faults the allocation took.
_ROUNDS = """
import json, resource, sys
import psutil
keep, block_bytes, num_blocks = sys.argv[1] == "keep", int(sys.argv[2]), int(sys.argv[3])
if keep:
    from serve.worker.cpu_malloc import keep_freed_memory
    assert keep_freed_memory()
process = psutil.Process()
rounds = []
for _ in range(3):
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [bytearray(block_bytes) for _ in range(num_blocks)]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    peak = process.memory_info().rss
    del blocks
    rounds.append({"peak": peak, "after_free": process.memory_info().rss, "faults": faults})
print(json.dumps(rounds))
"""


def run_rounds(keep: bool, block_bytes: int, num_blocks: int) -> list[dict[str, int]]:
    root = str(Path(serve.__file__).resolve().parents[1])  # this checkout's serve
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    argv = [sys.executable, "-c", _ROUNDS, "keep" if keep else "default"]
    done = subprocess.run(
        [*argv, str(block_bytes), str(num_blocks)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)


# 64 MiB in blocks below the ceiling: the activations of one step.
BLOCK_BYTES, NUM_BLOCKS = MMAP_THRESHOLD_MAX // 2, 4
NUM_PAGES = BLOCK_BYTES * NUM_BLOCKS // PAGE


def test_freed_blocks_stay_in_the_heap_and_are_reused():
    rounds = run_rounds(True, BLOCK_BYTES, NUM_BLOCKS)
    for round_ in rounds:
        assert round_["after_free"] > 0.8 * round_["peak"], round_
    first, *again = rounds
    assert first["faults"] > NUM_PAGES / 2  # the heap grew once...
    assert all(r["faults"] < NUM_PAGES / 10 for r in again), again  # ...and was reused


def test_glibc_defaults_hand_freed_blocks_back():
    """The comparison that makes the test above mean something: without the call, the
    same rounds return the pages at every free and fault them in afresh."""
    for round_ in run_rounds(False, BLOCK_BYTES, NUM_BLOCKS):
        assert round_["peak"] - round_["after_free"] > BLOCK_BYTES * NUM_BLOCKS / 2, round_
        assert round_["faults"] > NUM_PAGES / 2, round_


def test_blocks_above_the_ceiling_are_still_handed_back():
    """glibc always maps blocks over MMAP_THRESHOLD_MAX, so kernels keep their temporaries
    below it: one such block is returned at every free even after the call."""
    for round_ in run_rounds(True, 2 * MMAP_THRESHOLD_MAX, 1):
        assert round_["peak"] - round_["after_free"] > MMAP_THRESHOLD_MAX, round_
