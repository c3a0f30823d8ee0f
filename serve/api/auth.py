"""API keys: which paths need one, and a constant-time check of the key a request sends.

With keys set, every path needs one but the probes a load balancer or an orchestrator
sends without credentials (and /metrics, if the operator made it public). A path that
does not exist needs one too, so a client without a key learns nothing of the routes.
A key comes as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY`
(Anthropic's API), on any path.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from serve.api.errors import error_body
from serve.api.middleware import route_path

# The probes a load balancer polls without a key (vLLM guards only /v1/...).
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/load"})
METRICS_PATH = "/metrics"

UNAUTHORIZED_MESSAGE = (
    "Invalid or missing API key. Send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')."
)


def public_paths(metrics_public: bool) -> frozenset[str]:
    return PUBLIC_PATHS | {METRICS_PATH} if metrics_public else PUBLIC_PATHS


def is_authorized(authorization: bytes, keys: Iterable[bytes]) -> bool:
    """Whether an `Authorization` header value is `Bearer <one of keys>`.

    Every key is compared, in constant time, whatever the earlier ones gave: how long the
    check takes says nothing about which key matched, or how much of one.
    """
    scheme, _, token = authorization.partition(b" ")
    return is_key(token, keys) and scheme.lower() == b"bearer"


def is_key(token: bytes, keys: Iterable[bytes]) -> bool:
    """Whether `token` is one of `keys`, every key compared in constant time."""
    matched = False
    for key in keys:
        matched |= secrets.compare_digest(token, key)
    return matched


class APIKeyAuth:
    """ASGI middleware answering 401, in the error shape of the path's API, to a request
    without a valid key. It sits inside CORS, whose preflights carry no key."""

    def __init__(self, app: ASGIApp, keys: Iterable[str], public: frozenset[str]) -> None:
        self.app = app
        self.keys = tuple(key.encode() for key in keys)
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or route_path(scope) in self.public:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        bearer_ok = is_authorized(headers.get(b"authorization", b""), self.keys)
        x_api_key = headers.get(b"x-api-key")
        if bearer_ok or (x_api_key is not None and is_key(x_api_key, self.keys)):
            await self.app(scope, receive, send)
            return
        body = error_body(401, UNAUTHORIZED_MESSAGE, path=route_path(scope))
        response = JSONResponse(body, status_code=401)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
