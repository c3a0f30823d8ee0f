"""MultiprocExecutor at world size 2 over gloo, with the fake workers (fake_workers.py).

Steps reach every rank, in order, whatever their size, and rank 0's output comes back;
every rank holds the smallest block counts. A rank that dies or raises fails the call
within seconds, even while its peer is blocked in a collective, and every call after it.
No process outlives shutdown(), nor the executor's own process when that is SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from executor.builders import WORKERS, decode_step, make_config, ranks_rows, steps_of_every_size
from executor.fake_workers import digest, num_blocks_of

from serve.executor.base import Executor, WorkerFailedError
from serve.executor.multiproc import MultiprocExecutor

WORLD_SIZE = 2
NOTICE_S = 2.0  # a rank's death or error fails the call within this
REPO_ROOT = Path(__file__).resolve().parents[2]


def child_pids() -> set[int]:
    """This process's descendants, multiprocessing's resource tracker aside (it serves
    every spawn of this process and exits with it)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


@pytest.fixture
def no_leftovers():
    """Fails the test if it leaves a process behind (after its own shutdown)."""
    before = child_pids()
    yield
    assert child_pids() - before == set()


def start(worker: str) -> MultiprocExecutor:
    executor = Executor.create(make_config(WORLD_SIZE, "mp"), WORKERS + worker)
    assert isinstance(executor, MultiprocExecutor)
    return executor


def kill_rank_after(executor: MultiprocExecutor, rank: int, delay_s: float) -> list[float]:
    """SIGKILL `rank` after `delay_s`, from a thread; the list gets the time it did."""
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(delay_s)
        os.kill(executor.worker_pids[rank], signal.SIGKILL)
        killed_at.append(time.monotonic())

    threading.Thread(target=kill, daemon=True).start()
    return killed_at


def test_steps_reach_every_rank_in_order_and_shutdown_stops_them(no_leftovers):
    executor = start("EchoWorker")
    try:
        expected_blocks = [min(n) for n in zip(*(num_blocks_of(r) for r in range(WORLD_SIZE)))]
        assert [executor.num_blocks, executor.num_cpu_blocks] == expected_blocks == [990, 100]
        for index, step in enumerate(steps_of_every_size()):
            output = executor.execute_model(step)
            assert output.seq_ids == [s.seq_id for s in step.scheduled]
            assert ranks_rows(output) == [[index, digest(step), *expected_blocks]] * WORLD_SIZE
        executor.check_health()
    finally:
        executor.shutdown()
    assert [r.process.exitcode for r in executor._ranks] == [0, 0]  # exited, not killed
    executor.shutdown()  # idempotent
    with pytest.raises(WorkerFailedError, match="shut down"):
        executor.execute_model(decode_step(1))


def test_a_rank_killed_while_idle_is_noticed_by_check_health(no_leftovers):
    executor = start("EchoWorker")
    try:
        executor.execute_model(decode_step(2))
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < NOTICE_S:
            try:
                executor.check_health()
            except WorkerFailedError as e:
                error = e
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"check_health did not notice a dead rank in {NOTICE_S} s")
        assert str(error) == "Worker rank 1 died (killed by SIGKILL)"
        assert (error.rank, error.error_type) == (1, None)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError, match="rank 1 died"):
            executor.execute_model(decode_step(2))
        assert time.monotonic() - t0 < 0.1  # at once, without sending
    finally:
        executor.shutdown()


def test_a_rank_killed_while_its_peer_waits_in_a_collective(no_leftovers):
    executor = start("StallsAtStep1Worker")
    try:
        executor.execute_model(decode_step(2))
        killed_at = kill_rank_after(executor, rank=1, delay_s=0.5)
        with pytest.raises(WorkerFailedError, match=r"^Worker rank 1 died \(killed by SIGKILL\)"):
            executor.execute_model(decode_step(2))  # rank 0 waits in all_gather for rank 1
        assert time.monotonic() - killed_at[0] < NOTICE_S
        with pytest.raises(WorkerFailedError, match="rank 1 died"):
            executor.check_health()
    finally:
        executor.shutdown()


def test_a_rank_that_raises_fails_the_step_with_its_error(no_leftovers):
    executor = start("RaisesAtStep2Worker")
    try:
        for _ in range(2):
            executor.execute_model(decode_step(2))
        t0 = time.monotonic()
        with pytest.raises(WorkerFailedError) as raised:
            executor.execute_model(decode_step(2))  # rank 0 waits in all_gather
        assert time.monotonic() - t0 < NOTICE_S
        assert str(raised.value).startswith(
            "Worker rank 1 raised RuntimeError: injected failure on rank 1 at step 2"
        )
        assert (raised.value.rank, raised.value.error_type) == (1, "RuntimeError")
        with pytest.raises(WorkerFailedError, match="injected failure"):
            executor.check_health()
    finally:
        executor.shutdown()


def test_a_rank_that_fails_to_start_fails_the_constructor(no_leftovers):
    """A rank's ValueError (a start-up problem the user can fix, like a cache too small)
    keeps its type, as it would at one rank; the cause is the rank's failure."""
    t0 = time.monotonic()
    with pytest.raises(ValueError) as raised:
        start("FailsToStartWorker")  # rank 0 waits in the rendezvous for rank 1
    assert str(raised.value) == (
        "The workers could not start: Worker rank 1 raised ValueError: rank 1 cannot start: injected"
    )
    cause = raised.value.__cause__
    assert isinstance(cause, WorkerFailedError)
    assert (cause.rank, cause.error_type) == (1, "ValueError")
    assert time.monotonic() - t0 < 60  # not the group's timeout


_OWNER = """
import time
from serve.config import EngineConfig, ParallelConfig
from serve.executor.multiproc import MultiprocExecutor
from serve.step import SchedulerOutput
from serve.worker.worker import WorkerConfig

if __name__ == "__main__":
    engine = EngineConfig(parallel=ParallelConfig(2, "mp"), device="cpu")
    config = WorkerConfig(engine, model_path="unused", eos_token_ids=(0,))
    executor = MultiprocExecutor(config, "executor.fake_workers.EchoWorker")
    executor.execute_model(SchedulerOutput())
    print(*executor.worker_pids, flush=True)
    time.sleep(600)
"""


def test_workers_die_with_the_executors_process(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(_OWNER)
    paths = [str(REPO_ROOT), str(REPO_ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    owner = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    workers: list[psutil.Process] = []
    try:
        workers = [psutil.Process(int(pid)) for pid in owner.stdout.readline().split()]
        assert len(workers) == WORLD_SIZE
        owner.kill()
        owner.wait()
        gone, alive = psutil.wait_procs(workers, timeout=5)
        assert alive == [], f"workers outlived their executor's process: {alive}"
    finally:
        owner.kill()
        for worker in workers:
            if worker.is_running():
                worker.kill()
