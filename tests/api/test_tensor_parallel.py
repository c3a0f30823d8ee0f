"""A server with `--tensor-parallel-size 2` (two gloo ranks, one process each): the
openai client sees what one rank gives it; a worker rank that dies takes the engine down
within 2 s (requests fail, /health 503, exit 1); SIGTERM stops every process it started.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from api.conftest import start_server, stop_process
from gpu_share import ON_A_GPU_MACHINE, TWO_RANK_DEVICE

DEVICE = ("--device", TWO_RANK_DEVICE)
TP2 = ("--tensor-parallel-size", "2", *DEVICE)
# The one-rank server the two ranks are compared with (seeded samples differ across devices)
# runs on their device: the default server, unless its auto picks a GPU theirs does not.
ONE_RANK = DEVICE if ON_A_GPU_MACHINE and TWO_RANK_DEVICE == "cpu" else ()
DEATH_NOTICE_S = 2.0


def _engine_processes(server) -> tuple[psutil.Process, list[psutil.Process]]:
    """The engine core process and its worker ranks (spawned children running serve's
    code, not multiprocessing's resource tracker)."""

    def spawned(process: psutil.Process) -> list[psutil.Process]:
        return [p for p in process.children() if "resource_tracker" not in " ".join(p.cmdline())]

    (core,) = spawned(psutil.Process(server.process.pid))
    ranks = spawned(core)
    assert len(ranks) == 2, [p.cmdline() for p in ranks]
    return core, ranks


def _answers(server) -> tuple:
    """A chat reply, a streamed completion and two seeded samples, through the client."""
    client = server.client()
    reply = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=16,
        temperature=0,
    )
    stream = client.completions.create(
        model=server.model,
        prompt="Once upon a time",
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = "".join(chunk.choices[0].text for chunk in stream)
    sampled = client.completions.create(
        model=server.model,
        prompt="The capital of France",
        max_tokens=12,
        n=2,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    return reply.choices[0].message.content, streamed, [c.text for c in sampled.choices]


def test_the_client_gets_what_one_rank_gives_and_sigterm_stops_everything(
    server_factory, tiny_llama, tmp_path
):
    expected = _answers(server_factory(*ONE_RANK))
    server = start_server(tiny_llama, TP2, {}, tmp_path)
    try:
        answers = _answers(server)
        core, ranks = _engine_processes(server)
        everything = psutil.Process(server.process.pid).children(recursive=True)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(everything, timeout=10)
        assert not alive, f"left behind: {[p.cmdline() for p in alive]}"
        assert {core.pid, *(r.pid for r in ranks)} <= {p.pid for p in gone}
    finally:
        stop_process(server.process)
    assert answers == expected
    assert answers[1] and answers[2][0] != answers[2][1]


def test_a_killed_worker_rank_fails_requests_and_the_server_exits(tiny_llama, tmp_path):
    server = start_server(tiny_llama, TP2, {}, tmp_path)
    body = {
        "model": server.model,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        core, ranks = _engine_processes(server)
        started = [threading.Event() for _ in range(2)]
        ended_at = [0.0, 0.0]

        def stream(i: int) -> list[str]:
            with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=60) as r:
                lines = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        started[i].set()
            ended_at[i] = time.monotonic()
            return lines

        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(stream, i) for i in range(2)]
            assert all(event.wait(30) for event in started)
            ranks[1].send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            results = [s.result() for s in streams]
        for lines in results:
            assert lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2].removeprefix("data: "))["error"]
            assert error["type"] == "service_unavailable_error"
        assert max(ended_at) - killed_at < DEATH_NOTICE_S
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert server.process.wait(timeout=30) == 1
        assert "rank 1" in server.log()
        gone, alive = psutil.wait_procs([core, *ranks], timeout=10)
        assert not alive, f"left behind: {[p.pid for p in alive]}"
    finally:
        stop_process(server.process)


def test_a_ray_server_answers_and_sigterm_leaves_no_process(tiny_llama, tmp_path):
    """With `--distributed-executor-backend ray` the core starts a local Ray instance; on
    SIGTERM the ranks, Ray's own processes and the core all go, and the server exits 0."""
    pytest.importorskip("ray", reason="ray is not installed: pip install 'serve[ray]'")
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"}
    args = (*TP2, "--distributed-executor-backend", "ray")
    server = start_server(tiny_llama, args, env, tmp_path)
    try:
        reply = server.client().completions.create(
            model=server.model, prompt="Once upon a time", max_tokens=8, temperature=0
        )
        assert reply.usage.completion_tokens == 8
        everything = psutil.Process(server.process.pid).children(recursive=True)
        assert len(everything) >= 4  # the core, Ray's daemons, two rank actors
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(everything, timeout=15)
        assert not alive, f"left behind: {[p.cmdline()[:3] for p in alive]}"
    finally:
        stop_process(server.process)
