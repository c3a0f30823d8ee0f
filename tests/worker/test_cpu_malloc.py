"""On Linux with glibc, the CPU engine keeps freed activations in the heap for reuse."""

from __future__ import annotations

import platform
import sys

import pytest

from serve.worker.cpu_malloc import keep_freed_memory


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc's mallopt only",
)
def test_glibc_accepts_the_heap_thresholds():
    assert keep_freed_memory()
