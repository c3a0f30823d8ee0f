"""A few spawned CPU processes joined in one gloo tensor-parallel group, kept for a session.

    pool = RankPool(world_size=2)
    results = pool.run(fn, *args)   # fn(*args) on every rank at once; [rank 0's, rank 1's]

`fn` must be a module-level function (pickled by reference; the ranks import its module)
and may use `get_tp_group()` and its collectives. Starting processes and importing torch
is the slow part, so tests share one pool. A rank that raises fails `run` with that
rank's traceback; a rank that dies, or ranks left blocked in a collective after another
failed, are killed and the pool restarts on the next `run`.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a rank left waiting fails instead of hanging


class RankError(AssertionError):
    """A rank raised or died: the message holds every failing rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_rank(rank: int, world_size: int, init_method: str, jobs: Any, results: Any) -> None:
    import torch

    from serve.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)  # the ranks share the machine's cores
    try:
        init_tensor_parallel(world_size, rank, init_method, "gloo", timeout=COLLECTIVE_TIMEOUT)
        results.put((rank, True, None))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    while (job := jobs.get()) is not None:
        fn, args = job
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    destroy_tensor_parallel()


class RankPool:
    def __init__(self, world_size: int, timeout_s: float = 180.0, grace_s: float = 10.0) -> None:
        self.world_size, self.timeout_s, self.grace_s = world_size, timeout_s, grace_s
        self._procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_serve_rank,
                args=(rank, self.world_size, init_method, self._jobs[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._collect()  # every rank has joined the group

    def run(self, fn: Any, *args: Any) -> list[Any]:
        if not self._procs:
            self._start()
        for jobs in self._jobs:
            jobs.put((fn, args))
        return self._collect()

    def _collect(self) -> list[Any]:
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        give_up_at = time.monotonic() + self.timeout_s  # sooner once a rank has failed
        while len(values) + len(errors) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > give_up_at:
                    self.close()
                    errors.update({r: "died" for r in dead if r not in errors | values})
                    raise RankError(_describe(errors, "the other ranks never finished")) from None
                continue
            if ok:
                values[rank] = value
            else:
                errors[rank] = value
                give_up_at = min(give_up_at, time.monotonic() + self.grace_s)
        if errors:
            raise RankError(_describe(errors, ""))
        return [values[rank] for rank in range(self.world_size)]

    def close(self) -> None:
        for jobs, proc in zip(self._jobs, self._procs):
            if proc.is_alive():
                jobs.put(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe(errors: dict[int, str], note: str) -> str:
    parts = [f"rank {rank}:\n{text}" for rank, text in sorted(errors.items())]
    return "\n".join(parts + ([note] if note else []))
