"""RayExecutor: the ranks as Ray actors in one placement group, possibly over machines.

    execute_model ─ encode once, ray.put once ─▶ RayWorkerActor.run(ref), rank 0..N-1
                  ◀── rank 0's StepDone (the other ranks return None)
    a rank raised: its WorkerRaised reply · a rank died: RayActorError from its call

One bundle per rank (`PACK`: on as few machines as fit), one GPU each on CUDA (Ray gives
each actor its own through CUDA_VISIBLE_DEVICES, so every rank sees its GPU as cuda:0),
one CPU each on the CPU. The ranks' rendezvous is rank 0's node IP and a port free there.
Start-up and each step wait for every rank, and fail as soon as any rank raises or dies.

Trust: Ray moves arguments and results between its processes and machines with pickle
(cloudpickle). The messages here are plain data encoded with msgspec (messages.py), as
the mp executor's, but whoever can reach a Ray cluster's ports can run code in it: that
is Ray's trust model, and a Ray cluster belongs on a private network.

Cluster: an already initialised Ray in this process is used as it is; else `ray.init()`
joins the cluster at RAY_ADDRESS when set, or starts a local instance without a
dashboard; the executor disconnects (or stops the local instance) when it shuts down.
A local instance registers this machine's routable address and its servers listen on
every interface (Ray's own defaults, token-authenticated); with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment before Ray is imported, it uses
127.0.0.1 instead (as the tests do). Ray is an optional dependency (`pip install
'serve[ray]'`), imported here only when this executor is created.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
from dataclasses import replace
from typing import Any

from serve.executor.base import DEFAULT_WORKER_CLASS, Executor
from serve.executor.failures import FAILURE_GRACE_S, FailureLatch, RankFailure
from serve.executor.messages import (
    ExecuteModel,
    Shutdown,
    StepDone,
    WorkerCommand,
    WorkerRaised,
    WorkerReply,
    decode_command,
    decode_reply,
    encode,
)
from serve.executor.worker_process import CommandRunner, raised
from serve.step import ModelRunnerOutput, SchedulerOutput
from serve.worker.worker import WorkerConfig

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0  # for the cluster to find room for every rank
HEALTH_TIMEOUT_S = 10.0  # for an idle rank to answer check_health
SHUTDOWN_TIMEOUT_S = 5.0  # for healthy ranks to run Worker.shutdown() before they are killed


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError(
            "The 'ray' executor needs Ray, which is not installed: pip install 'serve[ray]'"
        ) from None
    return ray


class RayWorkerActor:
    """One rank in a Ray actor process: a CommandRunner behind `run(command) -> reply`."""

    def __init__(self) -> None:
        self.runner: CommandRunner | None = None

    def node_ip_and_free_port(self) -> tuple[str, int]:
        """Where rank 0 hosts the rendezvous."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def start(self, config: WorkerConfig, worker_class: str) -> bytes | None:
        """Build the worker; a WorkerRaised reply if that raised."""
        try:
            self.runner = CommandRunner(config, worker_class)
        except Exception as e:
            return encode(raised(e))
        return None

    def run(self, command: bytes) -> bytes | None:
        assert self.runner is not None, "start() first"
        try:
            reply = self.runner.run(decode_command(command))
        except Exception as e:
            reply = raised(e)
        return None if reply is None else encode(reply)

    def ping(self) -> int:
        return os.getpid()


class RayExecutor(Executor):
    def __init__(
        self, worker_config: WorkerConfig, worker_class: str = DEFAULT_WORKER_CLASS
    ) -> None:
        super().__init__(worker_config, worker_class)
        self._ray = ray = import_ray()
        from ray.util import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._latch = FailureLatch()
        self._actors: list[Any] = []
        self._placement_group: Any = None
        world_size = worker_config.engine.parallel.tensor_parallel_size
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(**_local_instance_args(world_size))
        atexit.register(self.shutdown)  # before Ray's own exit hook disconnects
        try:
            uses_gpus = _uses_gpus(worker_config.engine.device, ray)
            bundle = {"GPU": 1.0} if uses_gpus else {"CPU": 1.0}
            self._placement_group = placement_group([bundle] * world_size, strategy="PACK")
            try:
                ray.get(self._placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"The Ray cluster has no room for {world_size} ranks of {bundle} after "
                    f"{PLACEMENT_TIMEOUT_S:.0f} s (its resources: {ray.cluster_resources()})."
                ) from None
            actor_class = ray.remote(RayWorkerActor)
            for rank in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(self._placement_group, rank)
                options = {"num_gpus": 1, "num_cpus": 0} if uses_gpus else {"num_cpus": 1}
                self._actors.append(
                    actor_class.options(scheduling_strategy=strategy, **options).remote()
                )
            host, port = ray.get(self._actors[0].node_ip_and_free_port.remote())
            configs = [
                replace(
                    worker_config,
                    rank=rank,
                    world_size=world_size,
                    distributed_init_method=f"tcp://{host}:{port}",
                )
                for rank in range(world_size)
            ]
            self._wait_all([a.start.remote(c, worker_class) for a, c in zip(self._actors, configs)])
        except BaseException:
            self.shutdown()
            raise
        self._start_every_rank(self._call_every_rank)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._latch.raise_if_set()
        reply = self._call_every_rank(ExecuteModel(scheduler_output))[0]
        if not isinstance(reply, StepDone):
            kind = type(reply).__name__
            raise self._latch.set([RankFailure(0, f"sent {kind} for a step", kind)])
        return reply.output

    def check_health(self) -> None:
        self._latch.raise_if_set()
        self._wait_all([a.ping.remote() for a in self._actors], HEALTH_TIMEOUT_S)

    def shutdown(self) -> None:
        """Let healthy ranks run Worker.shutdown(), kill every actor, remove the placement
        group, and leave Ray if this executor joined or started it. Idempotent."""
        if self._latch.is_shut_down:
            return
        self._latch.is_shut_down = True
        atexit.unregister(self.shutdown)
        ray = self._ray
        if self._actors and self._latch.error is None:
            shutdown = ray.put(encode(Shutdown()))
            ray.wait(
                [a.run.remote(shutdown) for a in self._actors],
                num_returns=len(self._actors),
                timeout=SHUTDOWN_TIMEOUT_S,
            )
        for actor in self._actors:
            ray.kill(actor)
        if self._placement_group is not None:
            ray.util.remove_placement_group(self._placement_group)
        if self._owns_ray:
            ray.shutdown()

    # -- calls -----------------------------------------------------------------------------

    def _call_every_rank(self, command: WorkerCommand) -> list[WorkerReply | None]:
        data = self._ray.put(encode(command))  # once, for every rank
        return self._wait_all([a.run.remote(data) for a in self._actors])

    def _wait_all(self, refs: list[Any], timeout_s: float | None = None) -> list[Any]:
        """Every rank's result, by rank; WorkerFailedError as soon as any rank raises or
        dies (the others may be blocked in a collective)."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = self._ray.wait(pending, num_returns=1, timeout=timeout_s)
            if not ready:
                cause = f"did not answer in {timeout_s:.0f} s"
                raise self._latch.set([RankFailure(rank_of[pending[0]], cause, "TimeoutError")])
            outcome = self._outcome(rank_of[ready[0]], ready[0])
            if isinstance(outcome, RankFailure):
                raise self._latch.set([outcome, *self._later_failures(pending, rank_of)])
            results[rank_of[ready[0]]] = outcome
        return results

    def _outcome(self, rank: int, ref: Any) -> Any:
        """A finished call's result (a reply decoded), or the rank's RankFailure."""
        ray = self._ray
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            return RankFailure(rank, f"died ({_first_line(e)})", None)
        except ray.exceptions.RayTaskError as e:  # a Ray-side failure around the call
            return RankFailure(rank, f"raised {_first_line(e)}", type(e).__name__)
        reply = decode_reply(result) if isinstance(result, bytes) else result
        if isinstance(reply, WorkerRaised):
            logger.error("Worker rank %d raised:\n%s", rank, reply.traceback)
            return RankFailure(
                rank, f"raised {reply.error_type}: {reply.message}", reply.error_type
            )
        return reply

    def _later_failures(self, pending: list[Any], rank_of: dict[Any, int]) -> list[RankFailure]:
        """The failures of the calls in `pending` that end within FAILURE_GRACE_S
        (failures.py says why)."""
        if not pending:
            return []
        ready, _ = self._ray.wait(pending, num_returns=len(pending), timeout=FAILURE_GRACE_S)
        outcomes = [self._outcome(rank_of[ref], ref) for ref in ready]
        return [o for o in outcomes if isinstance(o, RankFailure)]


def _local_instance_args(world_size: int) -> dict[str, Any]:
    """`ray.init` arguments: RAY_ADDRESS's cluster, or a local instance with a CPU for
    each rank at least."""
    if os.environ.get("RAY_ADDRESS"):
        return {"address": os.environ["RAY_ADDRESS"]}
    return {
        "num_cpus": max(world_size, os.cpu_count() or 1),
        "include_dashboard": False,
    }


def _uses_gpus(device: str, ray: Any) -> bool:
    if device == "auto":
        return ray.cluster_resources().get("GPU", 0) >= 1
    return device.startswith("cuda")


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
