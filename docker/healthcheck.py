"""The images' HEALTHCHECK: exit 0 when serve's /health answers 200, else 1.

The address comes from serve's own command line (found in /proc), so a container started
with `--port 9000` or `--host 10.0.0.5` is checked where it listens; a wildcard address
is checked on loopback, over HTTPS where `--ssl-certfile` is given (the certificate is
not checked: it names the public host, not loopback). Standard library only: the image
has no curl.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.request
from pathlib import Path

TIMEOUT_S = 4.0


def serve_argv() -> list[str]:
    """The command line of the container's serve process (PID 1, or a child of an init)."""
    for pid in sorted(
        (p for p in Path("/proc").iterdir() if p.name.isdigit()), key=lambda p: int(p.name)
    ):
        try:
            argv = (pid / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(Path(arg).name == "serve" for arg in argv[:2]):
            return argv
    return []


def flag(argv: list[str], name: str, default: str) -> str:
    """The last value given for `name` (`--port 9000` or `--port=9000`), as argparse reads."""
    value = default
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def main() -> int:
    argv = serve_argv()
    host = flag(argv, "--host", os.environ.get("SERVE_HOST") or "127.0.0.1")
    port = flag(argv, "--port", "8000")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    scheme, context = "http", None
    if flag(argv, "--ssl-certfile", ""):
        scheme, context = "https", ssl._create_unverified_context()
    url = f"{scheme}://{host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as reply:
            return 0 if reply.status == 200 else 1
    except OSError as e:  # refused, timed out, or an HTTP error status (503 while draining)
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
