"""glibc malloc settings for a forward pass on CPU.

Every step allocates and frees the same large activations. By default glibc hands blocks
over 128 KiB back to the kernel when freed (munmap, or trimming the heap top), so each
step page-faults its activations in afresh: about a fifth of a prefill's time on the
default model (2 cores). With a high trim threshold and the largest mmap threshold glibc
allows, freed activations stay in the heap and the next step reuses them. The cost is
that the process keeps its peak heap, as it would under tcmalloc or jemalloc (vLLM's CPU
backend asks for one of those to be preloaded for the same reason), until an engine that
shuts down in a process that goes on (an `LLM`) hands it back: `release_freed_memory`.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for the mmap threshold on 64-bit (4 MiB * sizeof(long)); larger blocks
# are always mapped, so kernels keep their temporaries below it (reference.py).
MMAP_THRESHOLD_MAX = 32 << 20
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Make freed blocks up to MMAP_THRESHOLD_MAX stay in the heap for reuse. Returns
    whether it took effect (glibc on Linux only; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False
    done = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and done
    if not done:
        logger.debug("mallopt refused the heap thresholds; freed memory goes back to the OS")
    return done


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim), which the
    thresholds above otherwise keep for good. Returns whether any were released (False
    off glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    return malloc_trim(0) == 1
