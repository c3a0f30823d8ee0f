"""What the engine counts as this machine's free memory: the kernel's MemAvailable, capped
by a container's cgroup limit where one is set."""

from __future__ import annotations

import pytest

from serve import host_memory

GiB = 1 << 30


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A fake /proc/meminfo and cgroup v2 files; returns a function that writes them."""
    meminfo = tmp_path / "meminfo"
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    monkeypatch.setattr(host_memory, "_MEMINFO", meminfo)
    monkeypatch.setattr(host_memory, "_CGROUP_LIMITS", ((limit, usage),))

    def write(available_kib: int, cgroup_limit: str | None, cgroup_usage: int = 0) -> None:
        meminfo.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n")
        if cgroup_limit is not None:
            limit.write_text(cgroup_limit + "\n")
            usage.write_text(f"{cgroup_usage}\n")

    return write


def test_mem_available_without_a_cgroup_limit(machine):
    machine(10 * (GiB >> 10), None)
    assert host_memory.available_memory_bytes() == 10 * GiB
    machine(10 * (GiB >> 10), "max", 5 * GiB)  # a cgroup without a limit
    assert host_memory.available_memory_bytes() == 10 * GiB


def test_a_containers_limit_caps_it(machine):
    machine(10 * (GiB >> 10), str(4 * GiB), 1 * GiB)
    assert host_memory.available_memory_bytes() == 3 * GiB
    machine(2 * (GiB >> 10), str(4 * GiB), 1 * GiB)  # the host has less left than the limit
    assert host_memory.available_memory_bytes() == 2 * GiB
    machine(10 * (GiB >> 10), str(4 * GiB), 5 * GiB)  # over its limit (reclaimable cache)
    assert host_memory.available_memory_bytes() == 0


def test_this_machine_has_some():
    total, available = host_memory.physical_memory_bytes(), host_memory.available_memory_bytes()
    if available is None:
        pytest.skip("no /proc/meminfo here")
    assert total and 0 < available <= total
