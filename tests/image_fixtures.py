"""What the image tests share: images as PNG bytes and data URLs, a tiny HTTP server on
127.0.0.1 that serves them (and misbehaves on purpose: nothing leaves the machine), a
LLaVA prompt as HF renders and widens it, for the oracle, and processed prompts run
through an engine in the same steps."""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def widened(tokenizer, token_ids: list[int]) -> list[int]:
    """The prompt as the engine runs it: each `<image>` token a run of the image's size."""
    from tiny_models import IMAGE_TOKEN, LLAVA_TOKENS_PER_IMAGE

    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    out: list[int] = []
    for token_id in token_ids:
        out += [token_id] * (LLAVA_TOKENS_PER_IMAGE if token_id == image_id else 1)
    return out


def hf_chat_prompt(tokenizer, content) -> list[int]:
    """HF's rendering of one user turn, widened (its template reads `{"type": "image"}`
    parts, or a string)."""
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return widened(tokenizer, tokenizer(text, add_special_tokens=False).input_ids)


def run_in_steps(llm, prompts, params) -> list:
    """The finished outputs of `prompts` ((token ids, images) as
    `MultiModalProcessor.process` makes them), all added before the first step, in order."""
    for i, (token_ids, mm_inputs) in enumerate(prompts):
        llm.add_request(f"r{i}", token_ids, params, mm_inputs=mm_inputs)
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[f"r{i}"] for i in range(len(prompts))]


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (connecting is refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ImageServer:
    """`files`: path -> bytes served as image/png. Other paths:
    /slow (answers after `slow_s`), /endless (a body that never ends, no Content-Length),
    /huge (claims a huge Content-Length), /to-ftp (redirects to an ftp:// URL),
    anything else 404."""

    def __init__(self, slow_s: float = 30.0) -> None:
        self.files: dict[str, bytes] = {}
        self.slow_s = slow_s
        self.url = ""

    def handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path in server.files:
                    body = server.files[path]
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif path == "/slow":
                    time.sleep(server.slow_s)
                    self.send_response(200)
                    self.end_headers()
                elif path == "/endless":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    chunk = b"\0" * 65536
                    try:
                        while True:
                            self.wfile.write(chunk)
                    except OSError:
                        pass
                elif path == "/huge":
                    self.send_response(200)
                    self.send_header("Content-Length", str(1 << 40))
                    self.send_header("Connection", "close")
                    self.end_headers()
                elif path == "/to-ftp":
                    self.send_response(302)
                    self.send_header("Location", "ftp://127.0.0.1/cat.png")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self.send_error(404, "no such image")

        return Handler


@contextmanager
def image_server(slow_s: float = 30.0) -> Iterator[ImageServer]:
    served = ImageServer(slow_s)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), served.handler())
    httpd.daemon_threads = True
    served.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        httpd.shutdown()
        httpd.server_close()
