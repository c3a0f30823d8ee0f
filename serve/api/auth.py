"""API keys: which paths need one, and a constant-time check of the key a request sends.

With keys set, every path needs one but the probes a load balancer or an orchestrator
sends without credentials (and /metrics, if the operator made it public). A path that
does not exist needs one too, so a client without a key learns nothing of the routes.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from serve.api.errors import error_body

PUBLIC_PATHS = frozenset({"/health", "/version"})
METRICS_PATH = "/metrics"

UNAUTHORIZED_MESSAGE = "Invalid or missing API key. Send 'Authorization: Bearer KEY'."


def public_paths(metrics_public: bool) -> frozenset[str]:
    return PUBLIC_PATHS | {METRICS_PATH} if metrics_public else PUBLIC_PATHS


def is_authorized(authorization: bytes, keys: Iterable[bytes]) -> bool:
    """Whether an `Authorization` header value is `Bearer <one of keys>`.

    Every key is compared, in constant time, whatever the earlier ones gave: how long the
    check takes says nothing about which key matched, or how much of one.
    """
    scheme, _, token = authorization.partition(b" ")
    matched = False
    for key in keys:
        matched |= secrets.compare_digest(token, key)
    return matched and scheme.lower() == b"bearer"


class APIKeyAuth:
    """ASGI middleware answering 401, in OpenAI's error shape, to a request without a
    valid key. It sits inside CORS, whose preflights carry no `Authorization` header."""

    def __init__(self, app: ASGIApp, keys: Iterable[str], public: frozenset[str]) -> None:
        self.app = app
        self.keys = tuple(key.encode() for key in keys)
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        if is_authorized(headers.get(b"authorization", b""), self.keys):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(error_body(401, UNAUTHORIZED_MESSAGE), status_code=401)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
