"""The server with its engine core in a child process: killed, stopped, and under load.

A killed core turns /health to 503 and ends pending requests with an error within 2 s
(streamed or not), and then the server exits 1; SIGTERM stops the server with exit 0 and no child left behind; 64
concurrent streams through the split equal their non-streamed answers.
`--disable-frontend-multiprocessing` keeps the core on a thread of the API process.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
from api.conftest import start_server, stop_process

DEATH_NOTICE_S = 2.0
NUM_STREAMS = 64


def core_processes(server) -> list[psutil.Process]:
    """The server's engine core: its child started by multiprocessing's spawn (the other
    child, if any, is multiprocessing's resource tracker)."""
    children = psutil.Process(server.process.pid).children(recursive=True)
    return [p for p in children if "spawn_main" in " ".join(p.cmdline())]


def test_the_core_runs_in_a_child_process(server):
    (core,) = core_processes(server)
    assert core.is_running()


def test_without_frontend_multiprocessing_the_core_runs_in_process(server_factory, server):
    solo = server_factory("--disable-frontend-multiprocessing")
    assert core_processes(solo) == []
    body = {"prompt": "The sea is", "max_tokens": 8, "temperature": 0}
    texts = [
        httpx.post(f"{s.v1}/completions", json={"model": s.model, **body}, timeout=30).json()
        for s in (solo, server)
    ]
    assert texts[0]["choices"] == texts[1]["choices"]


def test_concurrent_streams_through_the_split_match_non_streamed(server):
    prompts = [f"Number {i}: the quick brown fox {i * 7}" for i in range(NUM_STREAMS)]
    body = {"model": server.model, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        expected = [
            http.post(f"{server.v1}/completions", json={**body, "prompt": p}).json()["choices"][0]
            for p in prompts
        ]

    async def stream(client: httpx.AsyncClient, prompt: str) -> tuple[str, str | None]:
        text, finish_reason = "", None
        request = {**body, "prompt": prompt, "stream": True}
        async with client.stream("POST", f"{server.v1}/completions", json=request) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                text += choice["text"]
                finish_reason = choice["finish_reason"] or finish_reason
        return text, finish_reason

    async def all_at_once() -> list[tuple[str, str | None]]:
        limits = httpx.Limits(max_connections=NUM_STREAMS)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(stream(client, p) for p in prompts))

    streamed = asyncio.run(all_at_once())
    assert streamed == [(c["text"], c["finish_reason"]) for c in expected]


def test_a_killed_core_fails_pending_requests_and_health(long_context_model, tmp_path):
    server = start_server(long_context_model, ("--max-model-len", "4096"), {}, tmp_path)
    try:
        (core,) = core_processes(server)
        body = {
            "model": server.model,
            "prompt": "Once upon a time",
            "max_tokens": 4000,
            "ignore_eos": True,
            "temperature": 0,
        }

        def plain_request() -> tuple[httpx.Response, float]:
            response = httpx.post(f"{server.v1}/completions", json=body, timeout=60)
            return response, time.monotonic()

        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(plain_request)
            request = {**body, "stream": True}
            with httpx.stream("POST", f"{server.v1}/completions", json=request, timeout=60) as r:
                events = (line for line in r.iter_lines() if line.startswith("data: "))
                next(events)  # running: kill the core mid-generation
                core.kill()
                killed = time.monotonic()
                rest = list(events)
                streamed_s = time.monotonic() - killed
            response, answered = plain.result()

        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable_error"
        assert "engine core process died" in error["message"]
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable_error"
        assert streamed_s < DEATH_NOTICE_S and answered - killed < DEATH_NOTICE_S
        assert httpx.get(f"{server.url}/health").status_code == 503
        # Then it exits non-zero, for a supervisor (Docker, Kubernetes) to restart it.
        assert server.process.wait(timeout=30) == 1
        assert server.log().count("The engine core process died: killed by SIGKILL") == 1
    finally:
        stop_process(server.process)


def test_a_start_up_error_in_the_core_is_the_clis_error(tiny_llama):
    """Raised in the core process, shown by the CLI as before: one line, exit 1."""
    cmd = [sys.executable, "-m", "serve.api.cli", "--model", str(tiny_llama)]
    result = subprocess.run(
        [*cmd, "--max-model-len", "100000"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "serve: error: max_model_len=100000 is longer than this model supports" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def test_sigterm_stops_the_server_and_its_core(tiny_llama, tmp_path):
    server = start_server(tiny_llama, (), {}, tmp_path)
    children = psutil.Process(server.process.pid).children(recursive=True)
    assert len(core_processes(server)) == 1
    try:
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=20) == 0, server.log()
        _, left = psutil.wait_procs(children, timeout=5)
        assert not left, f"left behind: {[p.cmdline() for p in left]}"
    finally:
        stop_process(server.process)
