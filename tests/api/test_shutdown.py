"""SIGTERM drains: running requests finish, new ones get 503 with Retry-After, and the
server exits 0 with no child left; past --shutdown-timeout the rest end with an error."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import psutil
from api.conftest import start_server, stop_process


def _stream(server, max_tokens: int, events: list[str], started: threading.Event) -> None:
    body = {
        "model": server.model,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = f"{server.v1}/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        started.set()  # headers: admitted (a random model's text may come late)
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))


def _start_streams(server, count: int, max_tokens: int) -> list[tuple[threading.Thread, list]]:
    streams = []
    for _ in range(count):
        events: list[str] = []
        started = threading.Event()
        thread = threading.Thread(target=_stream, args=(server, max_tokens, events, started))
        thread.start()
        assert started.wait(60)
        streams.append((thread, events))
    return streams


def _exits_cleanly(server) -> None:
    children = psutil.Process(server.process.pid).children(recursive=True)
    assert server.process.wait(timeout=60) == 0, server.log()
    _, left = psutil.wait_procs(children, timeout=5)
    assert not left, f"left behind: {[p.cmdline() for p in left]}"


def test_sigterm_lets_running_requests_finish(long_context_model, tmp_path):
    args = ("--max-model-len", "4096", "--shutdown-timeout", "120")  # a loaded CI machine
    server = start_server(long_context_model, args, {}, tmp_path)
    try:
        # ~3 s of decoding at 4 sequences: still running when the probes below arrive (500
        # tokens took 0.5-0.9 s, and the probes raced the drain's end)
        streams = _start_streams(server, 4, max_tokens=2000)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = httpx.post(
            f"{server.v1}/completions",
            json={"model": server.model, "prompt": "Hi", "max_tokens": 2},
            timeout=10,
        )
        health = httpx.get(f"{server.url}/health", timeout=10)
        for thread, _ in streams:
            thread.join(180)
        _exits_cleanly(server)
    finally:
        stop_process(server.process)

    assert refused.status_code == 503 and health.status_code == 503
    assert refused.headers["retry-after"].isdigit()
    assert refused.json()["error"]["type"] == "service_unavailable_error"
    for _, events in streams:
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 2000  # every stream ran to its end


def test_requests_past_the_shutdown_timeout_end_with_an_error(long_context_model, tmp_path):
    # 0.3 s: short beside the ~1.7 s the tiny model takes for 4000 tokens at batch 1.
    args = ("--max-model-len", "4096", "--shutdown-timeout", "0.3")
    server = start_server(long_context_model, args, {}, tmp_path)
    try:
        ((thread, events),) = _start_streams(server, 1, max_tokens=4000)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        thread.join(60)
        ended_s = time.monotonic() - signalled
        _exits_cleanly(server)
    finally:
        stop_process(server.process)

    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable_error"
    assert ended_s < 5  # the 0.3 s timeout, then the engine's stop: not the 4000 tokens
