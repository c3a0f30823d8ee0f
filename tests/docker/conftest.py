"""What the image test needs from this machine: a Docker daemon, a base image that needs
no registry, and this machine's pip package sources in a form a `docker build` can reach.

No registry answers here, so `python:3.11-slim-bookworm` cannot be pulled: the base is
built once from Debian packages (debootstrap, then `docker import`) and kept by its tag.
pip here reads local folders (`find-links`, `file://` indexes); a build cannot see the
host's files, so they are served over HTTP on 127.0.0.1 for a build on the host network.
And where TLS goes through an intercepting proxy, the CAs this machine added to its trust
store go into the build as EXTRA_CA_CERT.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from docker_cli import docker

BASE_TAG = "serve-test-base:bookworm"
BASE_PACKAGES = "python3,python3-venv,python3-pip,ca-certificates"
DEBIAN_MIRROR = os.environ.get("SERVE_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# A fixed port keeps the build arguments, and with them the layer cache, the same from
# run to run; when it is taken, any free port does (and that build misses the cache).
MIRROR_PORT = 38517
LOCAL_CA_DIR = Path("/usr/local/share/ca-certificates")  # Debian's place for added CAs


@pytest.fixture(scope="session")
def base_image() -> str:
    """A Debian bookworm image with python3.11, venv, pip and CA certificates."""
    if docker("image", "inspect", BASE_TAG, check=False).returncode == 0:
        return BASE_TAG
    if shutil.which("debootstrap") is None:
        pytest.skip(f"no base image {BASE_TAG} and no debootstrap to build it")
    if os.geteuid() != 0:
        pytest.skip(f"no base image {BASE_TAG}, and debootstrap needs root to build it")
    with tempfile.TemporaryDirectory(prefix="serve-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}"]
            + ["bookworm", str(rootfs), DEBIAN_MIRROR],
            check=True,
            capture_output=True,
            timeout=1800,
        )
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(
            ["docker", "import", "--change", 'CMD ["/bin/bash"]', "-", BASE_TAG],
            stdin=tar.stdout,
            check=True,
            capture_output=True,
            timeout=600,
        )
        tar.stdout.close()
        assert tar.wait() == 0
    return BASE_TAG


def pip_sources() -> dict[str, str]:
    """This machine's pip settings (global, user, PIP_* environment) for the sources:
    {"index-url" | "extra-index-url" | "find-links": "space-separated locations"}."""
    parser = configparser.ConfigParser()
    parser.read(["/etc/pip.conf", "/etc/xdg/pip/pip.conf", Path.home() / ".config/pip/pip.conf"])
    sources = {}
    for key in ("index-url", "extra-index-url", "find-links"):
        value = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if value is None and parser.has_option("global", key):
            value = parser.get("global", key)
        if value:
            sources[key] = " ".join(value.split())
    return sources


class _LocalFiles(SimpleHTTPRequestHandler):
    """Serves files under `roots` only, by their absolute paths."""

    roots: tuple[Path, ...] = ()

    def translate_path(self, path: str) -> str:
        local = Path(unquote(urlparse(path).path)).resolve()
        if any(local == root or root in local.parents for root in self.roots):
            return str(local)
        return "/nonexistent"

    def log_message(self, *args) -> None:
        pass


def _local_path(location: str) -> Path | None:
    if location.startswith("file://"):
        return Path(unquote(urlparse(location).path))
    if location.startswith("/"):
        return Path(location)
    return None


@pytest.fixture(scope="session")
def local_ca_certificates() -> str:
    """The CA certificates this machine trusts beyond the distribution's (PEM), or ""."""
    return "".join(path.read_text() for path in sorted(LOCAL_CA_DIR.glob("*.crt")))


@pytest.fixture(scope="session")
def pip_mirror_build_args(local_ca_certificates):
    """`--build-arg`s that give a build on the host network this machine's pip sources,
    local folders served over HTTP on 127.0.0.1 while the session lasts."""
    sources = pip_sources()
    roots = set()
    for key, locations in sources.items():
        for location in locations.split():
            path = _local_path(location)
            if path is not None:
                # An index's pages may link a level up (`../../files/x.whl`).
                roots.add(path if key == "find-links" else path.parent)
    handler = type("Handler", (_LocalFiles,), {"roots": tuple(p.resolve() for p in roots)})
    try:
        server = ThreadingHTTPServer(("127.0.0.1", MIRROR_PORT), handler)
    except OSError:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def over_http(location: str) -> str:
        path = _local_path(location)
        return location if path is None else base + str(path.resolve()) + "/"

    args = []
    for key, locations in sources.items():
        name = "PIP_" + key.upper().replace("-", "_")
        args += ["--build-arg", f"{name}={' '.join(map(over_http, locations.split()))}"]
    if local_ca_certificates:
        args += ["--build-arg", f"EXTRA_CA_CERT={local_ca_certificates}"]
    yield args
    server.shutdown()
    server.server_close()
