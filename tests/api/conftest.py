"""Real `serve` server processes for the API tests, and clients pointed at them.

Each distinct command line starts one process per test session (`server_factory`
memoizes them), so the suite pays a handful of start-ups, not one per test. Servers bind
127.0.0.1 on a free port and log to a file whose text failing tests can show.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

STARTUP_TIMEOUT_S = 60.0
DEFAULT_MODEL_STARTUP_TIMEOUT_S = 180.0  # the default model's first start converts a GGUF
REQUEST_TIMEOUT_S = 60.0
KV_CACHE_MEMORY = "64MiB"
# The checkout under test: a script entry (faulty_serve.py) starts its sys.path at its own
# folder, where `import serve` would find whatever checkout the virtualenv installed.
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    model: str  # the name clients send (the served model name)
    process: subprocess.Popen
    log_path: Path

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.v1, api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S
        )

    def async_client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.v1, api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S
        )


def scrape_metrics(server: Server, headers: dict[str, str] | None = None) -> dict[str, float]:
    """The server's /metrics samples (`metric_samples`)."""
    return metric_samples(httpx.get(f"{server.url}/metrics", headers=headers, timeout=10).text)


def metric_samples(text: str) -> dict[str, float]:
    """The samples of /metrics' text, as {'name{label="v",...}': value}, without the
    `model_name` and `engine` labels every vLLM-shaped series carries (a server serves one
    model, with one engine); cache_config_info, which has no model_name, keeps its engine."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            dropped = ("model_name", "engine") if "model_name" in sample.labels else ()
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k not in dropped
            )
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def wait_until_idle(server: Server, timeout_s: float = 30.0) -> dict[str, float]:
    """The metrics once the engine reports no request left (it reports when it idles)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape_metrics(server)
        prefix = "vllm:" if "vllm:num_requests_running" in metrics else "serve_"
        busy = sum(
            metrics.get(f"{prefix}num_requests_{state}", 1.0)
            for state in ("running", "waiting", "swapped")
        )
        if busy == 0 or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(process: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"serve exited with status {process.returncode} before it was healthy:\n"
                + log_path.read_text(errors="replace")
            )
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(
        f"serve was not healthy after {timeout_s:.0f}s:\n" + log_path.read_text(errors="replace")
    )


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)


def start_server(
    model: Path | None,
    extra_args: tuple[str, ...],
    env_overrides: dict[str, str],
    log_dir: Path,
    entry: tuple[str, ...] = ("-m", "serve.api.cli"),
) -> Server:
    """Start `python -m serve.api.cli` (or `python *entry`) and wait for /health.
    `model=None` serves the default model. The environment is the test's, minus
    SERVE_API_KEY and VLLM_API_KEY, plus `env_overrides`."""
    env = {k: v for k, v in os.environ.items() if k not in ("SERVE_API_KEY", "VLLM_API_KEY")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **env_overrides)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    last_error: Exception | None = None
    for _attempt in range(3):  # a free port can be taken between probing and binding
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, *entry, "--host", "127.0.0.1", "--port", str(port)]
        if model is not None:
            cmd += ["--model", str(model)]
        cmd += ["--kv-cache-memory", KV_CACHE_MEMORY, *extra_args]
        log_path = log_dir / f"serve-{port}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        timeout_s = STARTUP_TIMEOUT_S if model is not None else DEFAULT_MODEL_STARTUP_TIMEOUT_S
        try:
            _wait_healthy(process, url, log_path, timeout_s)
        except RuntimeError as e:
            stop_process(process)
            last_error = e
            if "address already in use" in str(e).lower():
                continue
            break
        headers = {}
        api_keys = _flag(extra_args, "--api-key") or env_overrides.get("SERVE_API_KEY")
        if api_keys:
            headers["Authorization"] = f"Bearer {api_keys.split(',')[0].strip()}"
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()
        return Server(url, models["data"][0]["id"], process, log_path)
    pytest.fail(str(last_error), pytrace=False)


def _flag(args: tuple[str, ...], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


# server_factory's servers by command line, least recently used first. At most
# MAX_LIVE_SERVERS run at once: starting another stops the least recently used one that
# the running test module has not asked for (the default `server` stays: session fixtures
# hold it); a later call starts it again. All stop once the last API test has run, not at
# the end of the session: each holds ~1 GB, and the suite has some thirty command lines.
MAX_LIVE_SERVERS = 6
_servers: dict[tuple, Server] = {}
_asked_in: dict[tuple, str] = {}  # the test module that last asked for each
_module = ""  # the running test's module


def _stop_servers() -> None:
    for server in _servers.values():
        stop_process(server.process)
    _servers.clear()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _module
    _module = str(item.path)  # before the item's fixtures are set up


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the session's last API test (a run may interleave API tests with others: the
    session fixtures keep the default server's address, so it must live until then)."""
    api_dir = Path(__file__).parent
    if nextitem is None or item is _last_api_item(item.session, api_dir):
        _stop_servers()


_LAST_API_ITEM = pytest.StashKey["pytest.Item | None"]()


def _last_api_item(session: pytest.Session, api_dir: Path) -> pytest.Item | None:
    if _LAST_API_ITEM not in session.stash:
        api_items = [i for i in session.items if api_dir in Path(i.path).parents]
        session.stash[_LAST_API_ITEM] = api_items[-1] if api_items else None
    return session.stash[_LAST_API_ITEM]


def _make_room(keep: tuple) -> None:
    for key in list(_servers):
        if len(_servers) < MAX_LIVE_SERVERS:
            return
        if key != keep and _asked_in.get(key) != _module:
            stop_process(_servers.pop(key).process)


@pytest.fixture(scope="session")
def server_factory(tiny_llama, tmp_path_factory):
    """`(*extra_args, model=tiny_llama, env=None) -> Server`, one process per distinct call
    (see MAX_LIVE_SERVERS), all stopped after the last API test. Pass `model=None` for the
    default model."""
    log_dir = tmp_path_factory.mktemp("serve-logs")
    default_key = (str(tiny_llama), (), ())

    def factory(*extra_args: str, model: Path | None = tiny_llama, env: dict | None = None):
        key = (str(model), extra_args, tuple(sorted((env or {}).items())))
        if key not in _servers:
            _make_room(keep=default_key)
            _servers[key] = start_server(model, extra_args, env or {}, log_dir)
        server = _servers.pop(key)
        _servers[key] = server  # the most recently used, last
        _asked_in[key] = _module
        assert server.process.poll() is None, f"serve died:\n{server.log()}"
        return server

    yield factory
    _stop_servers()


@pytest.fixture(scope="session")
def long_context_model(tiny_model_factory):
    """The tiny llama with a 4096-token context: requests that run for seconds."""
    return tiny_model_factory("llama", max_position_embeddings=4096)


@pytest.fixture(scope="session")
def server(server_factory) -> Server:
    """The tiny llama with default flags: most tests talk to this one."""
    return server_factory()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="session")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)
