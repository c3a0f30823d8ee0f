"""Graceful shutdown: on SIGTERM, refuse new requests, let the running ones finish for up
to `--shutdown-timeout` seconds, then end the rest with an error, then stop.

uvicorn alone would stop listening and, past its timeout, cancel the running requests:
their clients would see a connection cut mid-stream. Here the server keeps answering
while it drains (503 with Retry-After, and 503 on /health, so a load balancer moves on),
and requests still running at the deadline end the way a dead engine ends them: a 503 or
an error event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from serve.api.errors import error_body
from serve.engine.protocol import EngineClient

logger = logging.getLogger("serve.api")

RETRY_AFTER_S = 5
# After the engine stops, how long the requests it failed have to send their errors.
ERROR_FLUSH_S = 5.0
POLL_S = 0.05


class Draining:
    """The count of requests in flight, and whether the server has begun to drain."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.is_draining = False


class DrainingGate:
    """ASGI middleware: counts requests in flight; once draining, answers new ones 503."""

    def __init__(self, app: ASGIApp, draining: Draining) -> None:
        self.app, self.draining = app, draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining.is_draining:
            body = error_body(503, "The server is shutting down; retry on another replica.")
            headers = {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"}
            await JSONResponse(body, status_code=503, headers=headers)(scope, receive, send)
            return
        self.draining.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.draining.in_flight -= 1


class GracefulServer(uvicorn.Server):
    """uvicorn's server, draining requests before it stops listening."""

    def __init__(
        self, config: uvicorn.Config, engine: EngineClient, draining: Draining, timeout_s: float
    ) -> None:
        super().__init__(config)
        self.engine, self.draining, self.timeout_s = engine, draining, timeout_s

    async def shutdown(self, sockets: Any = None) -> None:
        self.draining.is_draining = True
        if self.draining.in_flight:
            logger.info(
                "Shutting down: waiting up to %.0f s for %d running request(s)",
                self.timeout_s,
                self.draining.in_flight,
            )
        if not await self._wait_idle(self.timeout_s):
            logger.warning(
                "Shutting down: %d request(s) still running after %.0f s end with an error",
                self.draining.in_flight,
                self.timeout_s,
            )
            await asyncio.to_thread(self.engine.shutdown)
            await self._wait_idle(ERROR_FLUSH_S)
        await super().shutdown(sockets)

    async def _wait_idle(self, timeout_s: float) -> bool:
        """Whether every request in flight finished within `timeout_s`. A second Ctrl-C
        or SIGTERM (uvicorn's force_exit) stops the wait."""
        deadline = time.monotonic() + timeout_s
        while self.draining.in_flight and not self.force_exit and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return not self.draining.in_flight
