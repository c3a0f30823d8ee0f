"""The core's busy loop: apply commands, step while requests run, reply, log stats.

The same loop runs on the in-process engine's thread and in a core process; only the
ends differ (a queue or a pipe for commands, stream delivery or a pipe for replies). The
replies are token deltas: the front end decodes them (output_processor.py).
It blocks on the command source while idle, so an idle engine costs nothing and wakes
the moment a request arrives; every HEALTH_CHECK_S of idleness it asks the executor
whether its workers are alive, so a dead worker ends an idle engine too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Protocol

from serve.engine.core import EngineCore
from serve.engine.messages import AbortRequest, Command, CoreStats, Stop, StopSequence
from serve.outputs import SpecDecodeStats
from serve.scheduler.output_deltas import RequestDelta

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 5.0  # the stats line
STATS_PUBLISH_S = 0.5  # CoreStats to the front end, while busy
HEALTH_CHECK_S = 0.5  # an idle engine's check on its workers


class CommandSource(Protocol):
    def get(self, block: bool, timeout: float | None = None) -> Command | None:
        """The next command; None when there is none (waiting up to `timeout` seconds,
        or not at all when `block` is False)."""


class ReplySink(Protocol):
    def put_step(self, deltas: list[RequestDelta]) -> None:
        """One step's token deltas (the requests that made progress). Also called from the
        core's helper thread while `core.step()` runs (nothing else is called meanwhile)."""

    def request_failed(self, request_id: str, error: Exception) -> None:
        """Adding the request failed: a ValueError refuses it as invalid; anything else
        is the engine's fault. Either way it fails alone."""

    def put_stats(self, stats: CoreStats) -> None:
        """The core's latest state and counters (for /metrics)."""


def run_core_loop(core: EngineCore, commands: CommandSource, replies: ReplySink) -> None:
    """Run until a Stop command. Whatever `core.step()` or the ends raise propagates: the
    caller decides how the engine dies."""
    stats = StatsLogger(core)
    published_at, changed = 0.0, True
    while True:
        # Idle: block until a command arrives. Busy: take whatever is queued.
        block = not core.has_unfinished_requests()
        now = time.monotonic()
        if changed and (block or now - published_at >= STATS_PUBLISH_S):
            replies.put_stats(core_stats(core))
            published_at, changed = now, False
        timeout = HEALTH_CHECK_S if block else None
        while (command := commands.get(block, timeout)) is not None:
            changed = True
            if block:
                stats.start_window(core)  # idle time is not throughput
            if isinstance(command, Stop):
                return
            _apply(core, command, replies)
            block, timeout = False, None
        if not core.has_unfinished_requests():
            core.check_health()  # raises if a worker died while the engine was idle
            continue
        deltas = core.step(deliver=replies.put_step)
        changed = True
        stats.record(core)
        if deltas:
            replies.put_step(deltas)


def core_stats(core: EngineCore) -> CoreStats:
    return CoreStats(core.stats(), core.num_generated_tokens, replace(core.step_times))


def _apply(core: EngineCore, command: Command, replies: ReplySink) -> None:
    if isinstance(command, AbortRequest):
        core.abort_request(command.request_id)  # the front end has ended it: no reply
        return
    if isinstance(command, StopSequence):
        final = core.stop_sequence(command.request_id, command.index)
        if final is not None:  # its last running sequence: siblings may have news
            replies.put_step([final])
        return
    try:
        core.add_request(
            command.request_id,
            command.prompt_token_ids,
            command.params,
            command.prompt,
            command.priority,
            command.lora,
            command.mm_inputs,
        )
    except ValueError as e:
        replies.request_failed(command.request_id, e)
    except Exception as e:  # a bug met by this request's input: it fails, the rest run on
        logger.exception("Request %s: adding it to the engine failed", command.request_id)
        replies.request_failed(command.request_id, e)


class StatsLogger:
    """The periodic stats line while the engine is busy."""

    def __init__(self, core: EngineCore) -> None:
        self.start_window(core)

    def start_window(self, core: EngineCore) -> None:
        self.last_log = time.monotonic()
        self.tokens_at_start = core.num_generated_tokens
        self.times_at_start = replace(core.step_times)
        spec = core.scheduler.spec_decode
        self.spec_at_start = SpecDecodeStats() if spec is None else spec.copy()

    def record(self, core: EngineCore) -> None:
        now = time.monotonic()
        if now - self.last_log < STATS_INTERVAL_S or not core.config.log_stats:
            return
        stats = core.stats()
        elapsed = now - self.last_log
        times = core.step_times.since(self.times_at_start)
        per_step_ms = 1000 / max(times.num_steps, 1)
        logger.info(
            "running %d, waiting %d, swapped %d requests; KV cache %.1f%% used, prefix cache "
            "hit rate %.1f%%; %d preemptions; generation %.1f tokens/s; forward busy %.0f%%; "
            "per step (ms): schedule %.1f, prepare %.1f, forward %.1f, sample %.1f, output %.1f "
            "(%.1f of them beside the forward)",
            stats.num_running,
            stats.num_waiting,
            stats.num_swapped,
            100 * stats.num_blocks_used / stats.num_blocks_total,
            100 * stats.prefix_cache_hit_rate,
            stats.num_preemptions,
            (core.num_generated_tokens - self.tokens_at_start) / elapsed,
            100 * times.forward_s / elapsed,
            times.schedule_s * per_step_ms,
            times.prepare_s * per_step_ms,
            times.forward_s * per_step_ms,
            times.sample_s * per_step_ms,
            times.output_s * per_step_ms,
            times.overlapped_s * per_step_ms,
        )
        spec = stats.spec_decode
        if spec is not None:
            drafts = spec.num_drafts - self.spec_at_start.num_drafts
            proposed = spec.num_draft_tokens - self.spec_at_start.num_draft_tokens
            accepted = spec.num_accepted_tokens - self.spec_at_start.num_accepted_tokens
            logger.info(
                "speculative decoding: %d drafts, %d proposed tokens, %d accepted "
                "(acceptance rate %.1f%%, mean accepted length %.2f)",
                drafts,
                proposed,
                accepted,
                100 * accepted / max(proposed, 1),
                1 + accepted / max(drafts, 1),
            )
        self.start_window(core)
