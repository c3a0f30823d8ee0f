"""Faults injected into a running server (tests/api/faulty_serve.py).

A fault in one request's processing fails that request alone with a 500 in OpenAI's
shape (an error event when streamed); the others complete and the server stays healthy.
A fatal fault in the forward pass fails every running request within 2 s, turns /health
to 503, and the server exits non-zero for its supervisor to restart it.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from api.conftest import start_server, stop_process
from api.openai_errors import assert_openai_error

DEATH_NOTICE_S = 2.0


def _faulty_server(model, fault: str, tmp_path, *args: str):
    entry = (str(Path(__file__).with_name("faulty_serve.py")),)
    return start_server(model, args, {"SERVE_TEST_FAULT": fault}, tmp_path, entry=entry)


def _stream_events(server, body: dict) -> list[dict | str]:
    """The data events of a streamed completion, decoded (the last is "[DONE]")."""
    events: list[dict | str] = []
    request = {"model": server.model, **body, "stream": True}
    with httpx.stream("POST", f"{server.v1}/completions", json=request, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_a_fault_in_one_request_fails_it_alone(tiny_llama, tmp_path):
    server = _faulty_server(tiny_llama, "decode-prompt:POISON", tmp_path)
    healthy = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(6) as pool:
            streams = [
                pool.submit(_stream_events, server, {**healthy, "prompt": f"Story {i}:"})
                for i in range(3)
            ]
            poisoned_stream = pool.submit(
                _stream_events, server, {**healthy, "prompt": "POISON in a stream"}
            )
            poisoned = pool.submit(
                httpx.post,
                f"{server.v1}/chat/completions",
                json={
                    "model": server.model,
                    "messages": [{"role": "user", "content": "POISON, not streamed"}],
                    **healthy,
                },
                timeout=60,
            )
            plain = pool.submit(
                httpx.post,
                f"{server.v1}/completions",
                json={"model": server.model, "prompt": "Story 3:", **healthy},
                timeout=60,
            )

            error = assert_openai_error(poisoned.result(), 500)
            assert error["type"] == "internal_server_error"
            assert "InjectedFault: cannot decode this request's text" in error["message"]
            assert "Other requests were not affected" in error["message"]

            events = poisoned_stream.result()
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["type"] == "internal_server_error"

            for stream in streams:
                events = stream.result()
                assert events[-1] == "[DONE]" and "error" not in events[-2]
                assert events[-2]["choices"][0]["finish_reason"] == "length"
            assert plain.result().json()["usage"]["completion_tokens"] == 24

        assert httpx.get(f"{server.url}/health").status_code == 200
        again = httpx.post(
            f"{server.v1}/completions",
            json={"model": server.model, "prompt": "After", **healthy},
            timeout=60,
        )
        assert again.json()["choices"][0]["finish_reason"] == "length"
        assert server.process.poll() is None
    finally:
        stop_process(server.process)


def test_a_fatal_forward_error_fails_everyone_and_exits_non_zero(long_context_model, tmp_path):
    trigger = tmp_path / "fail-forward-now"
    server = _faulty_server(
        long_context_model,
        f"forward-once-exists:{trigger}",
        tmp_path,
        "--max-model-len",
        "4096",
    )
    body = {
        "model": server.model,
        "prompt": "Once upon a time",
        "max_tokens": 4000,
        "ignore_eos": True,
        "temperature": 0,
    }
    try:
        started = [threading.Event() for _ in range(3)]
        ended_at: list[float] = [0.0] * 3

        def stream(i: int) -> list[str]:
            request = {**body, "stream": True}
            with httpx.stream("POST", f"{server.v1}/completions", json=request, timeout=60) as r:
                lines = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        started[i].set()
            ended_at[i] = time.monotonic()
            return lines

        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(stream, i) for i in range(3)]
            for event in started:
                assert event.wait(30)
            plain = pool.submit(httpx.post, f"{server.v1}/completions", json=body, timeout=60)
            time.sleep(0.5)  # the plain request is running too
            trigger.touch()
            failed_at = time.monotonic()
            results = [s.result() for s in streams]
            response = plain.result()
            answered_at = time.monotonic()

        for lines in results:
            assert lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2].removeprefix("data: "))["error"]
            assert error["type"] == "service_unavailable_error"
            assert "CUDA error" in error["message"]
        assert_openai_error(response, 503)
        assert max(ended_at) - failed_at < DEATH_NOTICE_S
        assert answered_at - failed_at < DEATH_NOTICE_S
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert server.process.wait(timeout=30) == 1
        log = server.log()
        assert log.count("The engine core process died") == 1
        assert "InjectedFault: CUDA error" in log
    finally:
        stop_process(server.process)
