"""Graceful shutdown: on SIGTERM, refuse new requests, let the running ones finish for up
to `--shutdown-timeout` seconds, then end the rest with an error, then stop. And the
other way a server ends: when its engine dies, it answers 503 for a few seconds (the
requests in flight get their errors), then exits 1 for its supervisor to restart it,
never living on with a dead engine.

uvicorn alone would stop listening and, past its timeout, cancel the running requests:
their clients would see a connection cut mid-stream. Here the server keeps answering
while it drains (admission.py answers 503 with Retry-After, /health included), and
requests still running at the deadline end the way a dead engine ends them: a 503 or an
error event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import uvicorn

from serve.api.admission import Admission
from serve.engine.protocol import EngineClient

logger = logging.getLogger("serve.api")

# After the engine stops, how long the requests it failed have to send their errors.
ERROR_FLUSH_S = 5.0
POLL_S = 0.05
DEAD_ENGINE_EXIT_S = 3.0  # from the engine's death to the server's exit


class GracefulServer(uvicorn.Server):
    """uvicorn's server, draining requests before it stops listening."""

    def __init__(
        self, config: uvicorn.Config, engine: EngineClient, admission: Admission, timeout_s: float
    ) -> None:
        super().__init__(config)
        self.engine, self.admission, self.timeout_s = engine, admission, timeout_s
        self.engine_died = False  # the server stopped because its engine died: exit 1
        self._dead_since: float | None = None

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's check, ten times a second, of whether to stop."""
        if await super().on_tick(counter):
            return True
        if self.engine.is_alive:
            return False
        now = time.monotonic()
        if self._dead_since is None:
            self._dead_since = now
            logger.error(
                "The engine is dead; the server exits in %.0f s so that its supervisor "
                "restarts it.",
                DEAD_ENGINE_EXIT_S,
            )
        self.engine_died = now - self._dead_since >= DEAD_ENGINE_EXIT_S
        return self.engine_died

    async def shutdown(self, sockets: Any = None) -> None:
        self.admission.is_draining = True
        if self.admission.in_flight:
            logger.info(
                "Shutting down: waiting up to %.0f s for %d running request(s)",
                self.timeout_s,
                self.admission.in_flight,
            )
        if not await self._wait_idle(self.timeout_s):
            logger.warning(
                "Shutting down: %d request(s) still running after %.0f s end with an error",
                self.admission.in_flight,
                self.timeout_s,
            )
            await asyncio.to_thread(self.engine.shutdown)
            await self._wait_idle(ERROR_FLUSH_S)
        await super().shutdown(sockets)

    async def _wait_idle(self, timeout_s: float) -> bool:
        """Whether every request in flight finished within `timeout_s`. A second Ctrl-C
        or SIGTERM (uvicorn's force_exit) stops the wait."""
        deadline = time.monotonic() + timeout_s
        while self.admission.in_flight and not self.force_exit and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return not self.admission.in_flight
