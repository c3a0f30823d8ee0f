"""The access log and the last word on unexpected errors, as plain ASGI middleware.

Plain ASGI rather than Starlette's BaseHTTPMiddleware: the endpoint keeps the server's own
`receive`, so `request.is_disconnected()` sees a client that hangs up, and a streamed
response is logged when it really ends.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.api.errors import error_body
from serve.api.protocol import CLIENT_REQUEST_ID

logger = logging.getLogger("serve.api")
access_logger = logging.getLogger("serve.access")

# nginx's code for "the client closed the connection before the response was complete".
CLIENT_CLOSED = 499


# A client's own X-Request-Id is taken as the request's id when it is this plain.
_CLIENT_REQUEST_ID = re.compile(CLIENT_REQUEST_ID)


class AccessLog:
    """One line per request, the 401s of a missing key and CORS preflights included: it
    is the outermost middleware, and sets the request id the rest of the app uses: the
    client's X-Request-Id where it sends a plain one, else a new one. Every response
    carries it back as X-Request-Id, so a client's report finds its line in the log.

    `quiet_paths`: paths logged only when they fail (a health probe every few seconds);
    `enabled`: False logs no line at all (metrics still count every response)."""

    def __init__(
        self,
        app: ASGIApp,
        on_response: Callable[[int], None] | None = None,
        quiet_paths: frozenset[str] = frozenset(),
        enabled: bool = True,
    ) -> None:
        self.app = app
        self.on_response = on_response  # called with each response's status (metrics)
        self.quiet_paths, self.enabled = quiet_paths, enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = scope.setdefault("state", {})
        # The client's own id names its response too (the handlers read it from here).
        state["client_request_id"] = client_id = _client_request_id(scope)
        state["request_id"] = request_id = client_id or uuid.uuid4().hex[:12]
        start = time.perf_counter()
        status = CLIENT_CLOSED
        is_stream = False

        async def send_and_watch(message: Message) -> None:
            nonlocal status, is_stream
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = dict(message.get("headers", []))
                is_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                message = {
                    **message,
                    "headers": [
                        *message.get("headers", []),
                        (b"x-request-id", request_id.encode()),
                    ],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            # A stream cut short by a hang-up never records its usage (it does at its end).
            if is_stream and state.get("usage") is None:
                status = CLIENT_CLOSED
            if self.enabled and (status >= 400 or not self._is_quiet(scope)):
                _log(scope, status, start)
            if self.on_response is not None:
                self.on_response(status)

    def _is_quiet(self, scope: Scope) -> bool:
        return route_path(scope) in self.quiet_paths


class RootPath:
    """--root-path, the prefix a proxy serves the API under: set as every request's
    `root_path`, where routing strips it from a path that leads with it (`route_path`) and
    the schema lists it as the server's URL. A path may carry it or not, as vLLM's app
    answers both (a proxy that strips it, one that passes it on). The outermost layer."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app, self.root_path = app, root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


def route_path(scope: Scope) -> str:
    """The path the app routes by: without the proxy's prefix (--root-path) where it
    leads the path (a proxy that passes it on), as Starlette's routing strips it."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


def _client_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if _CLIENT_REQUEST_ID.fullmatch(text):
                return text
    return None


class InternalErrors:
    """A 500 (in the path's API's error shape) for an exception no handler took, logged
    with its traceback.

    Starlette's own last resort (ServerErrorMiddleware, which runs an `Exception` handler)
    raises the exception again after answering: uvicorn then logs it a second time and
    drops the keep-alive connection, so the client's next request on it fails. Here it
    ends with the answer. A response already started can only be cut short: it is logged.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_and_watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except Exception:
            request_id = scope.get("state", {}).get("request_id", "?")
            logger.exception("Internal error in request %s", request_id)
            if not started:
                message = (
                    f"Internal server error (request {request_id}); the server log has details."
                )
                body = error_body(500, message, path=route_path(scope))
                await JSONResponse(body, status_code=500)(scope, receive, send)


def _log(scope: Scope, status: int, start: float) -> None:
    state = scope.get("state", {})
    usage = state.get("usage") or {}
    access_logger.info(
        '%s "%s %s" %d prompt_tokens=%s completion_tokens=%s %.0fms',
        state.get("request_id", "-"),
        scope.get("method", "-"),
        scope.get("path", "-"),
        status,
        usage.get("prompt_tokens", "-"),
        usage.get("completion_tokens", "-"),
        1000 * (time.perf_counter() - start),
    )
