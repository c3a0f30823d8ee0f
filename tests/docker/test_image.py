"""The CPU image end to end: built (layer cache kept between runs), started, healthy, one
chat completion from the default model, serve as PID 1 and not root, and `docker stop`
draining and exiting 0 well before the drain's limit. The mirror arguments and the extra
CA certificate the build was given are nowhere in the final image.

Marked `docker`; skipped when no Docker daemon answers (CI has none). The first run builds
a Debian base (conftest.py) and the image: minutes; later runs reuse both.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import openai
import pytest
from docker_cli import daemon_unavailable_reason, docker

REASON = daemon_unavailable_reason()
pytestmark = [pytest.mark.docker, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

REPO_ROOT = Path(__file__).resolve().parents[2]
IMAGE = "serve-test:latest"
BUILD_TIMEOUT_S = 3600.0
HEALTHY_TIMEOUT_S = 300.0
SHUTDOWN_TIMEOUT_S = 20.0  # serve's --shutdown-timeout: the most a drain may take
MIRROR_ARG_NAMES = (
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_FIND_LINKS",
    "PIP_TRUSTED_HOST",
    "TORCH_INDEX_URL",
    "EXTRA_CA_CERT",
)


@pytest.fixture(scope="module")
def image(base_image, pip_mirror_build_args) -> str:
    build = docker(
        "build",
        "--network=host",  # for the pip sources this machine serves on 127.0.0.1
        "--force-rm",  # no containers left behind by a failed step
        "--file",
        str(REPO_ROOT / "docker/Dockerfile"),
        "--tag",
        IMAGE,
        "--build-arg",
        f"BASE_IMAGE={base_image}",
        # torch 2.13.0+cpu is among this machine's pip sources; download.pytorch.org is not
        # reachable from here.
        "--build-arg",
        "TORCH_INDEX_URL=",
        *pip_mirror_build_args,
        str(REPO_ROOT),
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return IMAGE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inspect(container: str, template: str) -> str:
    return docker("inspect", "--format", template, container).stdout.strip()


def wait_healthy(container: str) -> float:
    """Seconds from now until the image's HEALTHCHECK reports healthy."""
    start = time.monotonic()
    while time.monotonic() - start < HEALTHY_TIMEOUT_S:
        state = json.loads(inspect(container, "{{json .State}}"))
        if not state["Running"]:
            logs = docker("logs", container, check=False)
            pytest.fail(f"the container exited ({state['ExitCode']}):\n{logs.stderr[-3000:]}")
        if (state.get("Health") or {}).get("Status") == "healthy":
            return time.monotonic() - start
        time.sleep(1.0)
    pytest.fail(f"not healthy after {HEALTHY_TIMEOUT_S:.0f} s")


def test_image_serves_as_non_root_and_stops_at_once_with_exit_0(image):
    port = free_port()
    container = f"serve-test-{port}"
    docker(
        "run",
        "--detach",
        "--name",
        container,
        "--network=host",
        "--health-interval=2s",  # the image's own check, run more often than its 15 s
        image,
        "--port",
        str(port),
        "--kv-cache-memory",
        "256MiB",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
    )
    try:
        seconds_to_healthy = wait_healthy(container)
        print(f"healthy after {seconds_to_healthy:.1f} s")

        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
        )
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
        )
        assert reply.choices[0].message.content
        assert 0 < reply.usage.completion_tokens <= 8

        # PID 1 is serve itself (so SIGTERM reaches it), and it does not run as root.
        status = docker("exec", container, "cat", "/proc/1/status", "/proc/1/cmdline").stdout
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        assert set(uid_line.split()[1:]) == {"10001"}, uid_line
        assert "/opt/venv/bin/serve" in status

        start = time.monotonic()
        docker("stop", "--time", str(int(SHUTDOWN_TIMEOUT_S) + 30), container, timeout=120)
        seconds_to_stop = time.monotonic() - start
        print(f"stopped in {seconds_to_stop:.1f} s")
        assert inspect(container, "{{.State.ExitCode}}") == "0"
        assert seconds_to_stop < SHUTDOWN_TIMEOUT_S
    finally:
        docker("rm", "--force", "--volumes", container, check=False)


def test_mirror_arguments_stay_out_of_the_final_image(image, local_ca_certificates):
    env = json.loads(docker("image", "inspect", "--format", "{{json .Config.Env}}", image).stdout)
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    certificate_lines = [line for line in local_ca_certificates.splitlines() if "---" not in line]
    for text in (" ".join(env), history):
        assert not any(name in text for name in MIRROR_ARG_NAMES)
        assert "127.0.0.1:" not in text
        assert not any(line in text for line in certificate_lines)
    assert "SERVE_HOST=0.0.0.0" in env
