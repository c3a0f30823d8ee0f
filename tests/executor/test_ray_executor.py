"""RayExecutor on a local Ray instance (2 CPUs, no dashboard, 127.0.0.1 only), shared by
the module's tests since starting Ray takes seconds.

Steps round-trip at world size 2 with every rank in step; a killed actor fails the step
with WorkerFailedError; shutdown kills the actors and removes the placement group, and
leaves alone the Ray it did not start.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

# Ray reads this once, when imported: off, a local instance registers its node as
# 127.0.0.1 (not the machine's routable address), so the tests' traffic stays on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'serve[ray]'")

from executor.builders import (  # noqa: E402
    WORKERS,
    decode_step,
    make_config,
    ranks_rows,
    steps_of_every_size,
)
from executor.fake_workers import digest  # noqa: E402

from serve.executor.base import Executor, WorkerFailedError  # noqa: E402
from serve.executor.ray_executor import RayExecutor  # noqa: E402

WORLD_SIZE = 2
NOTICE_S = 2.0


def start(worker: str) -> RayExecutor:
    executor = Executor.create(make_config(WORLD_SIZE, "ray"), WORKERS + worker)
    assert isinstance(executor, RayExecutor)
    return executor


def test_steps_round_trip_and_shutdown_removes_actors_and_group(local_ray):
    executor = start("EchoWorker")
    try:
        assert (executor.num_blocks, executor.num_cpu_blocks) == (990, 100)
        for index, step in enumerate(steps_of_every_size()):
            output = executor.execute_model(step)
            assert output.seq_ids == [s.seq_id for s in step.scheduled]
            assert ranks_rows(output) == [[index, digest(step), 990, 100]] * WORLD_SIZE
        executor.check_health()
        actors, group = list(executor._actors), executor._placement_group
    finally:
        executor.shutdown()
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote(), timeout=30)
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
    assert ray.is_initialized()  # the test's own instance: not the executor's to stop
    executor.shutdown()  # idempotent
    with pytest.raises(WorkerFailedError, match="shut down"):
        executor.execute_model(decode_step(1))


def test_a_killed_actor_fails_the_step(local_ray):
    executor = start("StallsAtStep1Worker")
    try:
        executor.execute_model(decode_step(2))
        pid = ray.get(executor._actors[1].ping.remote())
        killed_at: list[float] = []

        def kill() -> None:
            time.sleep(0.5)  # rank 0 is in the collective by then, rank 1 asleep
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

        threading.Thread(target=kill, daemon=True).start()
        with pytest.raises(WorkerFailedError, match="^Worker rank 1 died") as raised:
            executor.execute_model(decode_step(2))
        assert time.monotonic() - killed_at[0] < NOTICE_S
        assert (raised.value.rank, raised.value.error_type) == (1, None)
        with pytest.raises(WorkerFailedError, match="rank 1 died"):
            executor.check_health()
    finally:
        executor.shutdown()
