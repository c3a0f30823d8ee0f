"""Admission: what the server refuses before it parses a request's body, tokenizes, or
asks the engine for anything.

- While it drains for shutdown (shutdown.py): every request gets 503 with Retry-After,
  `/health` included, so a load balancer moves on.
- Past `--max-num-queued-requests` generation (and embedding) requests beyond what one step can run
  (`--max-num-seqs`): 503 with Retry-After, at once, instead of an unbounded queue.
- A body over `--max-request-body-bytes`: 413, by its Content-Length or, for a chunked
  body, as soon as what has arrived passes the cap.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.api.errors import error_body
from serve.api.middleware import route_path

GENERATION_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/embeddings"}
)
DRAINING_RETRY_AFTER_S = 5
QUEUE_FULL_RETRY_AFTER_S = 1


@dataclass
class Admission:
    max_generating: int | None = None  # generation requests in flight; None: no cap
    max_body_bytes: int | None = None
    is_draining: bool = False
    in_flight: int = 0  # every HTTP request being answered
    num_generating: int = 0  # of those, completions, chat completions and messages


class AdmissionGate:
    """ASGI middleware applying `Admission`'s limits and keeping its counts."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app, self.admission = app, admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.admission
        if limits.is_draining:
            message = "The server is shutting down; retry on another replica."
            await _refuse(503, message, DRAINING_RETRY_AFTER_S, scope, receive, send)
            return
        generating = scope["method"] == "POST" and route_path(scope) in GENERATION_PATHS
        if (
            generating
            and limits.max_generating is not None
            and limits.num_generating >= limits.max_generating
        ):
            message = (
                f"The server is at capacity ({limits.num_generating} requests running or "
                "queued, --max-num-queued-requests); retry shortly."
            )
            await _refuse(503, message, QUEUE_FULL_RETRY_AFTER_S, scope, receive, send)
            return
        # Counted before the body is read (an await): requests arriving together must
        # each see the others, or a burst passes the cap whole.
        limits.in_flight += 1
        limits.num_generating += generating
        try:
            if limits.max_body_bytes is not None and scope["method"] in ("POST", "PUT", "PATCH"):
                body = await _read_body(scope, receive, limits.max_body_bytes)
                if body is None:
                    message = (
                        f"The request body is larger than this server accepts "
                        f"({limits.max_body_bytes} bytes, --max-request-body-bytes)."
                    )
                    await _refuse(413, message, None, scope, receive, send)
                    return
                receive = _replay(body, receive)
            await self.app(scope, receive, send)
        finally:
            limits.in_flight -= 1
            limits.num_generating -= generating


async def _read_body(scope: Scope, receive: Receive, max_bytes: int) -> bytes | None:
    """The whole body, or None once it is known to pass `max_bytes`."""
    headers = dict(scope.get("headers", []))
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        return None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client left; the app sees an empty body and the disconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body already read, then the client's own
    messages (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _refuse(
    status: int, message: str, retry_after_s: int | None, scope: Scope, receive: Receive, send: Send
) -> None:
    headers = {"Connection": "close"}
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    body = error_body(status, message, path=route_path(scope))
    response = JSONResponse(body, status_code=status, headers=headers)
    await response(scope, receive, send)
