"""A `serve` server as a child process of a benchmark: start it, wait until healthy, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 300  # the default model's first start converts its GGUF


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model: str | None, flags: list[str], log_dir: Path, name: str, tree: Path | None = None
) -> tuple[subprocess.Popen, str, Path]:
    """(process, base url, log path) of a healthy server; exits the benchmark if it fails.
    `tree`: a checkout of serve (another version) to run instead of the installed one."""
    port = free_port()
    cmd = [sys.executable, "-m", "serve.api.cli", "--port", str(port)]
    cmd += ["--model", model] if model else []
    cmd += flags
    log_path = log_dir / f"serve-{name}-{port}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tree)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(process, url, log_path, name)
    return process, url, log_path


def wait_until_healthy(
    process: subprocess.Popen,
    url: str,
    log_path: Path,
    name: str,
    timeout_s: float = STARTUP_TIMEOUT_S,
) -> None:
    """Poll `url`/health until it answers 200; exits the benchmark, with the server's log,
    if the process dies or `timeout_s` passes (any OpenAI-compatible server with /health)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"{name} server exited:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    sys.exit(f"{name} server did not start:\n{log_path.read_text()}")


def stop_server(process: subprocess.Popen) -> int:
    """SIGTERM (the server drains and exits), then kill if it hangs; its exit code."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()
