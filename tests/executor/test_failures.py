"""FailureLatch: which rank a failure blames, and that every later call raises it again."""

from __future__ import annotations

import pytest

from serve.executor.base import WorkerFailedError
from serve.executor.failures import FailureLatch, RankFailure

ECHO = RankFailure(0, "raised RuntimeError: Connection closed by peer", "RuntimeError")
KILLED = RankFailure(1, "died (killed by SIGKILL)", None)
RAISED = RankFailure(1, "raised ValueError: bad input", "ValueError")


def test_a_silent_death_is_blamed_before_the_echoes_seen_first():
    error = FailureLatch().set([ECHO, KILLED])
    assert str(error) == (
        "Worker rank 1 died (killed by SIGKILL); also rank 0 raised RuntimeError: "
        "Connection closed by peer"
    )
    assert (error.rank, error.error_type) == (1, None)


def test_else_the_first_failure_seen_is_blamed():
    error = FailureLatch().set([RAISED, ECHO])
    assert str(error).startswith("Worker rank 1 raised ValueError: bad input; also rank 0")
    assert (error.rank, error.error_type) == (1, "ValueError")


def test_the_first_failure_is_raised_again_by_every_later_call():
    latch = FailureLatch()
    latch.raise_if_set()
    first = latch.set([RAISED])
    assert str(latch.set([KILLED])) == str(first)  # the first call wins
    with pytest.raises(WorkerFailedError) as again:
        latch.raise_if_set()
    assert again.value is not first and str(again.value) == str(first)


def test_after_shutdown_every_call_raises():
    latch = FailureLatch()
    latch.is_shut_down = True
    with pytest.raises(WorkerFailedError, match="shut down"):
        latch.raise_if_set()
