"""`docker` commands for the tests, and whether a Docker daemon answers at all."""

from __future__ import annotations

import shutil
import subprocess


def docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=check
    )


def daemon_unavailable_reason() -> str | None:
    """Why no Docker daemon can be used, or None when one answers."""
    if shutil.which("docker") is None:
        return "no `docker` command on PATH"
    try:
        info = docker("info", "--format", "{{.ServerVersion}}", timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer in 30 s"
    if info.returncode != 0:
        return f"no Docker daemon answers (`docker info`: {info.stderr.strip()[-300:]})"
    return None
