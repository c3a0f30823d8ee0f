"""serve bench's client against a fake OpenAI server: what it sends for a request with
images, how it reads a streamed chat answer (text, timing, usage), and that text requests
still go to /v1/completions."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from serve.bench.cli import main as bench_main
from serve.bench.client import send
from serve.bench.datasets import Request

IMAGE_TOKENS = 100  # the fake server's count for each image in a prompt
PIXEL = "data:image/png;base64,iVBORw0KGgo="  # the fake server does not decode images


class FakeOpenAI(BaseHTTPRequestHandler):
    """`/v1/models`, and streamed `/v1/chat/completions` and `/v1/completions` as vLLM
    answers them: (chat) a first chunk with the role and no text, one chunk a token (a
    short pause before each), a last chunk with only usage, [DONE]. A prompt counts a
    token a word or id, and IMAGE_TOKENS an image."""

    bodies: list[dict]  # set per server: every POST body received, in order
    gap_s = 0.01

    def do_GET(self) -> None:
        self._send_json({"data": [{"id": "fake-vlm", "max_model_len": 4096}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        if self.path == "/v1/chat/completions":
            (message,) = body["messages"]
            parts = message["content"]
            words = sum(len(p["text"].split()) for p in parts if p["type"] == "text")
            images = sum(p["type"] == "image_url" for p in parts)
            num_output = body["max_completion_tokens"]
        elif self.path == "/v1/completions":
            words, images, num_output = len(body["prompt"]), 0, body["max_tokens"]
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        is_chat = self.path == "/v1/chat/completions"
        if is_chat:
            self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(num_output):
            time.sleep(self.gap_s)
            text = {"delta": {"content": f" w{i}"}} if is_chat else {"text": f" w{i}"}
            self._event({"choices": [{"index": 0, **text}]})
        usage = {
            "prompt_tokens": words + IMAGE_TOKENS * images,
            "completion_tokens": num_output,
            "total_tokens": words + IMAGE_TOKENS * images + num_output,
        }
        self._event({"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, chunk: dict) -> None:
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.flush()

    def _send_json(self, value: dict) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture
def fake_server() -> Iterator[tuple[str, list[dict]]]:
    """The fake's base URL and the list of chat bodies it receives."""
    bodies: list[dict] = []
    handler = type("Handler", (FakeOpenAI,), {"bodies": bodies})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        server.shutdown()
        server.server_close()


def test_a_request_with_images_is_a_streamed_chat_message(fake_server):
    url, bodies = fake_server
    request = Request("look at these", 4, text_prompt_tokens=3, image_urls=(PIXEL, PIXEL))

    async def go():
        async with httpx.AsyncClient(base_url=url) as client:
            return await send(client, "fake-vlm", request, temperature=0.5)

    result = asyncio.run(go())
    (body,) = bodies
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "fake-vlm" and body["ignore_eos"] is True
    assert body["max_completion_tokens"] == 4 and body["temperature"] == 0.5
    assert "prompt" not in body and "max_tokens" not in body
    assert body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look at these"},
                {"type": "image_url", "image_url": {"url": PIXEL}},
                {"type": "image_url", "image_url": {"url": PIXEL}},
            ],
        }
    ]
    assert result.error is None and result.is_success
    # the server's count, image tokens included, replaces the dataset's estimate
    assert result.num_prompt_tokens == 3 + 2 * IMAGE_TOKENS
    assert result.num_output_tokens == 4 and result.num_images == 2
    # the role-only first chunk is not the first token: one TTFT, then a gap per token
    assert len(result.itl_s) == 3
    assert result.ttft_s >= FakeOpenAI.gap_s
    assert all(gap >= FakeOpenAI.gap_s * 0.5 for gap in result.itl_s)
    assert result.ttft_s + sum(result.itl_s) <= result.e2e_s


def test_a_request_of_token_ids_is_still_a_completion(fake_server):
    url, bodies = fake_server

    async def go():
        async with httpx.AsyncClient(base_url=url) as client:
            return await send(client, "fake-vlm", Request([5, 6, 7], 3))

    result = asyncio.run(go())
    (body,) = bodies
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 3
    assert "messages" not in body and body["stream_options"] == {"include_usage": True}
    assert result.is_success and result.num_images == 0
    assert result.num_prompt_tokens == 3 and len(result.itl_s) == 2


def test_random_image_run_reports_images_and_records_their_settings(fake_server, tmp_path, capsys):
    url, bodies = fake_server
    out = tmp_path / "out"
    flags = ["--base-url", url, "--dataset", "random-image", "--num-requests", "3"]
    flags += ["--images-per-request", "2", "--image-size", "16x8-32x24", "--no-progress"]
    flags += ["--min-prompt", "5", "--max-prompt", "9", "--min-output", "2", "--max-output", "3"]
    assert bench_main([*flags, "--output-dir", str(out), "--no-plots"]) == 0
    result = json.loads((out / "results.json").read_text())
    config = result["config"]
    assert config["dataset"] == "random-image"
    assert config["image_size"] == "16x8-32x24" and config["images_per_request"] == 2
    (run,) = result["runs"]
    summary = run["summary"]
    assert summary["num_successful"] == 3 and summary["num_images_sent"] == 6
    assert summary["images_per_request"] == 2.0
    assert summary["images_per_s"] == pytest.approx(6 / summary["duration_s"])
    requests = run["requests"]
    assert all(r["num_images"] == 2 for r in requests)
    assert all(
        5 + 2 * IMAGE_TOKENS <= r["num_prompt_tokens"] <= 9 + 2 * IMAGE_TOKENS for r in requests
    )
    assert summary["num_prompt_tokens"] == sum(r["num_prompt_tokens"] for r in requests)
    # a warm-up (two tokens, with its images) and then the run
    assert len(bodies) == 4 and bodies[0]["max_completion_tokens"] == 2
    assert all(
        part["image_url"]["url"].startswith("data:image/png;base64,")
        for body in bodies
        for part in body["messages"][0]["content"]
        if part["type"] == "image_url"
    )
    table = capsys.readouterr().out
    assert "Images sent" in table and "Image throughput (img/s)" in table
