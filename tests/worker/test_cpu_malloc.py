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
keep, block_bytes, num_blocks = sys.argv[1] != "default", int(sys.argv[2]), int(sys.argv[3])
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
if sys.argv[1] == "release":
    from serve.worker.cpu_malloc import release_freed_memory
    assert release_freed_memory()
    rounds.append({"after_release": process.memory_info().rss})
print(json.dumps(rounds))
"""


def run_python(source: str, *args: str) -> list[dict[str, int]]:
    """`source` run in a fresh interpreter that imports this checkout's serve; its JSON."""
    root = str(Path(serve.__file__).resolve().parents[1])  # this checkout's serve
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(
        [sys.executable, "-c", source, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])


def run_rounds(mode: str, block_bytes: int, num_blocks: int) -> list[dict[str, int]]:
    """mode: "default" (glibc's settings), "keep" (keep_freed_memory), "release" (keep,
    then release_freed_memory after the rounds)."""
    return run_python(_ROUNDS, mode, str(block_bytes), str(num_blocks))


# 64 MiB in blocks below the ceiling: the activations of one step.
BLOCK_BYTES, NUM_BLOCKS = MMAP_THRESHOLD_MAX // 2, 4
NUM_PAGES = BLOCK_BYTES * NUM_BLOCKS // PAGE


def test_freed_blocks_stay_in_the_heap_and_are_reused():
    rounds = run_rounds("keep", BLOCK_BYTES, NUM_BLOCKS)
    for round_ in rounds:
        assert round_["after_free"] > 0.8 * round_["peak"], round_
    first, *again = rounds
    assert first["faults"] > NUM_PAGES / 2  # the heap grew once...
    assert all(r["faults"] < NUM_PAGES / 10 for r in again), again  # ...and was reused


def test_glibc_defaults_hand_freed_blocks_back():
    """The comparison that makes the test above mean something: without the call, the
    same rounds return the pages at every free and fault them in afresh."""
    for round_ in run_rounds("default", BLOCK_BYTES, NUM_BLOCKS):
        assert round_["peak"] - round_["after_free"] > BLOCK_BYTES * NUM_BLOCKS / 2, round_
        assert round_["faults"] > NUM_PAGES / 2, round_


def test_blocks_above_the_ceiling_are_still_handed_back():
    """glibc always maps blocks over MMAP_THRESHOLD_MAX, so kernels keep their temporaries
    below it: one such block is returned at every free even after the call."""
    for round_ in run_rounds("keep", 2 * MMAP_THRESHOLD_MAX, 1):
        assert round_["peak"] - round_["after_free"] > MMAP_THRESHOLD_MAX, round_


def test_release_hands_the_kept_blocks_back():
    *rounds, released = run_rounds("release", BLOCK_BYTES, NUM_BLOCKS)
    kept = rounds[-1]["after_free"]
    assert kept - released["after_release"] > BLOCK_BYTES * NUM_BLOCKS / 2, (rounds, released)


# An engine on CPU in this process, then its shutdown: RSS with the engine built and run,
# and after `shutdown()` with the `LLM` still referenced.
_ENGINE = """
import json, sys
import psutil
from serve import LLM, SamplingParams
process = psutil.Process()
llm = LLM(model=sys.argv[1], kv_cache_memory="96MiB", enable_prefix_caching=False)
llm.generate(["Hello there"] * 4, SamplingParams(max_tokens=8), use_tqdm=False)
running = process.memory_info().rss
llm.shutdown()
print(json.dumps([{"running": running, "shut_down": process.memory_info().rss}]))
"""


def test_an_engine_s_shutdown_hands_its_memory_back(tiny_llama):
    """Tensors under glibc's mmap ceiling (here the KV cache's, a layer's keys or values
    each; in the default model the weights and their packed copies, ~1 GB) are heap
    blocks the CPU worker keeps after their free: `LLM.shutdown` returns them to the OS,
    as a notebook that goes on after it expects."""
    ((rss,),) = [run_python(_ENGINE, str(tiny_llama))]
    assert rss["running"] - rss["shut_down"] > 64 * MIB, rss
