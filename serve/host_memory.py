"""This machine's memory as the engine sizes its CPU buffers against it: the RAM in all,
and what is free to take now (the container's limit counts where there is one)."""

from __future__ import annotations

import os
from pathlib import Path

_MEMINFO = Path("/proc/meminfo")
# cgroup v2, then v1: the limit a container runs under, and what it uses of it now.
_CGROUP_LIMITS = (
    (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
    (
        Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
        Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ),
)


def physical_memory_bytes() -> int | None:
    """This machine's RAM, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory_bytes() -> int | None:
    """Memory a new allocation can take without swapping or the OOM killer: the kernel's
    MemAvailable, capped by the cgroup's room left (limit - usage) where a limit is set;
    None where neither is readable (not Linux)."""
    available = None
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    for limit_path, usage_path in _CGROUP_LIMITS:
        try:
            limit_text = limit_path.read_text().strip()
            usage = int(usage_path.read_text())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit() and int(limit_text) < (1 << 60):  # "max" / huge: no limit
            room = max(int(limit_text) - usage, 0)
            available = room if available is None else min(available, room)
        break
    return available
