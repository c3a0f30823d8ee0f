"""What an executor knows of its workers' failures, and which one it blames.

When one rank fails, its peers often fail right after it: a rank that raises exits, and
the others' collective loses its partner and raises in turn ("Connection closed by
peer"). The message the user reads should name the first cause, not its echoes, so an
executor that sees a failure waits up to FAILURE_GRACE_S for the other ranks' news, then
blames, in this order:

1. the first rank seen to die without a word (killed, crashed): nothing a peer sends can
   have caused it, and it is often reported after its peers' echoes (Ray);
2. else the first rank seen to raise.

The others follow in the message ("; also rank 0 raised ..."). From then on every call
raises the same error at once: the ranks are out of step, and nothing can go on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from serve.executor.base import WorkerFailedError

logger = logging.getLogger(__name__)

FAILURE_GRACE_S = 0.5  # after a first failure, for the other ranks' to arrive


@dataclass(frozen=True)
class RankFailure:
    rank: int
    cause: str  # "raised ValueError: ...", "died (killed by SIGKILL)"
    error_type: str | None  # the class name of what it raised; None: died without a word


class FailureLatch:
    """An executor's first failure (or its shutdown), raised again by every later call."""

    def __init__(self) -> None:
        self.error: WorkerFailedError | None = None
        self.is_shut_down = False

    def set(self, failures: list[RankFailure]) -> WorkerFailedError:
        """Record the failures seen together, in the order seen (the first call wins);
        an exception to raise."""
        if self.error is None:
            silent_deaths = [f for f in failures if f.error_type is None]
            blamed = (silent_deaths or failures)[0]
            message = f"Worker rank {blamed.rank} {blamed.cause}"
            others = [f"rank {f.rank} {f.cause}" for f in failures if f is not blamed]
            if others:
                message += "; also " + "; ".join(others)
            logger.error("%s", message)
            self.error = WorkerFailedError(message, blamed.rank, blamed.error_type)
        return self._fresh()

    def raise_if_set(self) -> None:
        if self.error is not None:
            raise self._fresh()
        if self.is_shut_down:
            raise WorkerFailedError("The executor was shut down.")

    def _fresh(self) -> WorkerFailedError:
        """A new exception each time: raising one object again grows its traceback."""
        assert self.error is not None
        return WorkerFailedError(str(self.error), self.error.rank, self.error.error_type)
