"""Who runs first: the order of the scheduler's queues under each --scheduling-policy.

The scheduler keeps its queues in the policy's order, each sorted by `rank` every step
(the last running group is the first preempted, the first waiting one the first
admitted). Everything else about a step (budgets, decodes before prefill chunks, block
accounting, chunking, prefix hits, swap) is the scheduler's and the same for all.

- fcfs: arrival order.
- priority: the request's `priority` (lower first), then arrival (vLLM's semantics). A
  waiting request that cannot start for want of blocks or batch seats preempts running
  requests of lower priority (`preempts_for_waiting`).
- sjf: shortest predicted remaining output first (length_predictor.py; a prediction never
  exceeds the request's own `max_tokens`, or what its context leaves). Starvation is
  being passed over, so the bound counts only that: the time a request spends queued
  (waiting or swapped) while a request that arrived after it runs. Its rank shrinks
  linearly with that time and is 0 once it reaches `max_wait_s`, where the request is
  ahead of every later arrival: none waits longer than the bound for requests that came
  after it. Time spent behind earlier arrivals, the queueing fcfs would have too, does
  not count (counting it, as plain age does, serves a congested queue in arrival order
  just when reordering it pays most). A waiting request predicted to need under half
  what a running one still needs takes its seat or blocks (shortest remaining first,
  SRPT-style), unless that one is past the bound. Until the predictor has learned, every
  rank is 0: arrival order, and no one is preempted.

Writers: the per-request state here (features, predictions) is the policy's, written on
the scheduler's thread; the predictor's model, by its refit thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from serve.config import SchedulerConfig
from serve.scheduler.length_predictor import (
    HiddenProjection,
    OutputLengthPredictor,
    prompt_features,
)
from serve.sequence import FinishReason, SequenceGroup

Rank = tuple[float, ...]


class SchedulingPolicy:
    """First come, first served; the base of the others."""

    name = "fcfs"
    preempts_for_waiting = False

    def start_step(self, now: float, queued: Iterable[SequenceGroup]) -> None:
        """The scheduler's clock at the start of a step, before it orders its queues, and
        the groups that waited (or were swapped) since the last step was scheduled."""

    def step_scheduled(self, running: Sequence[SequenceGroup]) -> None:
        """The groups that run in the step just scheduled."""

    def rank(self, group: SequenceGroup) -> Rank:
        """Lower runs first; the last running is preempted first."""
        return (group.arrival_time,)

    def order(self, groups: Iterable[SequenceGroup]) -> list[SequenceGroup]:
        """A queue (running, swapped or waiting), in `rank` order."""
        return sorted(groups, key=self.rank)

    def yields_to(self, running: SequenceGroup, waiting: SequenceGroup) -> bool:
        """With `preempts_for_waiting`: whether `running` gives up its seat or blocks when
        `waiting` cannot start without them."""
        return self.rank(running) > self.rank(waiting)

    def on_add(self, group: SequenceGroup) -> None:
        """A request was queued."""

    def on_admit(self, group: SequenceGroup) -> None:
        """A waiting request was admitted (it may be again, after a preemption)."""

    def on_prompt_hidden_state(self, group: SequenceGroup, hidden: list[float]) -> None:
        """The model's final hidden state at the request's last prompt token."""

    def on_finish(self, group: SequenceGroup) -> None:
        """A request ended (finished, aborted or failed)."""

    @property
    def wants_prompt_hidden_states(self) -> bool:
        return False

    @property
    def predictor_error(self) -> float | None:
        """sjf: the predictor's mean absolute error in tokens, once it predicts."""
        return None

    @property
    def longest_passed_over_s(self) -> float | None:
        """sjf: the longest any request has waited while later arrivals ran (its bound)."""
        return None

    def close(self) -> None:
        pass


class PriorityPolicy(SchedulingPolicy):
    name = "priority"
    preempts_for_waiting = True

    def rank(self, group: SequenceGroup) -> Rank:
        return (group.priority, group.arrival_time)


@dataclass
class _Prediction:
    features: np.ndarray
    cap: int  # the most tokens the request may generate: no prediction exceeds it
    hidden: np.ndarray | None = None
    tokens: float | None = None  # expected output tokens, whole request
    version: int = -1  # the predictor's version `tokens` came from
    at_admission: float | None = None  # for the error gauge
    passed_over_s: float = 0.0  # seconds queued while a later arrival ran


class ShortestJobFirstPolicy(SchedulingPolicy):
    name = "sjf"
    preempts_for_waiting = True
    # A running request yields only to one predicted to need less than this share of its
    # own remaining output: preempting costs recomputing (or swapping) its context, and
    # predictions are rough, so near-equals must not trade places.
    yield_ratio = 0.5

    def __init__(
        self,
        max_model_len: int,
        max_wait_s: float,
        predictor: OutputLengthPredictor | None = None,
    ) -> None:
        self.max_model_len = max_model_len
        self.max_wait_s = max_wait_s
        self.predictor = predictor or OutputLengthPredictor()
        self._projection: HiddenProjection | None = None
        self._requests: dict[str, _Prediction] = {}
        self._last_step: float | None = None
        self._latest_running_arrival: float | None = None  # in the last step scheduled
        self._longest_passed_over_s = 0.0

    def start_step(self, now: float, queued: Iterable[SequenceGroup]) -> None:
        last, self._last_step = self._last_step, now
        latest = self._latest_running_arrival
        if last is None or latest is None:
            return
        for group in queued:
            if group.arrival_time < latest:
                entry = self._requests.get(group.request_id)
                if entry is not None:
                    entry.passed_over_s += min(now - last, now - group.arrival_time)
                    self._longest_passed_over_s = max(
                        self._longest_passed_over_s, entry.passed_over_s
                    )

    def step_scheduled(self, running: Sequence[SequenceGroup]) -> None:
        self._latest_running_arrival = max((g.arrival_time for g in running), default=None)

    def rank(self, group: SequenceGroup) -> Rank:
        entry = self._requests.get(group.request_id)
        if entry is None or entry.tokens is None:
            return (0.0, group.arrival_time)  # nothing predicted: arrival order
        generated = max(seq.num_output_tokens for seq in group.seqs)
        remaining = max(1.0, entry.tokens - generated)
        aging = max(0.0, 1.0 - entry.passed_over_s / self.max_wait_s)
        return (remaining * aging, group.arrival_time)

    def order(self, groups: Iterable[SequenceGroup]) -> list[SequenceGroup]:
        groups = list(groups)
        self._refresh(groups)
        return sorted(groups, key=self.rank)

    def yields_to(self, running: SequenceGroup, waiting: SequenceGroup) -> bool:
        self._refresh([running, waiting])
        return self.rank(waiting)[0] < self.yield_ratio * self.rank(running)[0]

    def on_add(self, group: SequenceGroup) -> None:
        params = group.sampling_params
        if params.is_prefill_only:
            # No output to predict (rank 0: it is the shortest job there is, so a waiting
            # one may take a running request's seat, as SRPT would), and none to learn
            # from: its empty output says nothing of generation requests.
            return
        room = self.max_model_len - len(group.prompt_token_ids)
        cap = room if params.max_tokens is None else min(room, params.max_tokens)
        features = prompt_features(group.prompt_token_ids, cap)
        self._requests[group.request_id] = _Prediction(features, cap)

    def on_admit(self, group: SequenceGroup) -> None:
        entry = self._requests.get(group.request_id)
        if entry is not None and entry.at_admission is None:
            self._refresh([group])
            entry.at_admission = entry.tokens

    @property
    def wants_prompt_hidden_states(self) -> bool:
        return True

    def on_prompt_hidden_state(self, group: SequenceGroup, hidden: list[float]) -> None:
        entry = self._requests.get(group.request_id)
        if entry is None:
            return
        if self._projection is None:
            self._projection = HiddenProjection(len(hidden))
        entry.hidden = self._projection(hidden)
        entry.version = -1  # predict again, with the hidden state

    def on_finish(self, group: SequenceGroup) -> None:
        entry = self._requests.pop(group.request_id, None)
        if entry is None or any(s.finish_reason is FinishReason.ABORT for s in group.seqs):
            return  # aborted or failed: its length says nothing of the request
        length = max(seq.num_output_tokens for seq in group.seqs)
        self.predictor.observe(entry.features, entry.hidden, length, entry.at_admission)

    @property
    def predictor_error(self) -> float | None:
        return self.predictor.mean_absolute_error if self.predictor.is_active else None

    @property
    def longest_passed_over_s(self) -> float | None:
        return self._longest_passed_over_s

    def close(self) -> None:
        self.predictor.close()

    def _refresh(self, groups: list[SequenceGroup]) -> None:
        """Predict, in one batch, for the groups whose prediction predates the model."""
        version = self.predictor.version
        stale = [
            (g.request_id, e)
            for g in groups
            if (e := self._requests.get(g.request_id)) is not None and e.version != version
        ]
        if not stale:
            return
        predictions = self.predictor.predict_many(
            [e.features for _, e in stale],
            [e.hidden for _, e in stale],
            [e.cap for _, e in stale],
        )
        for (_, entry), tokens in zip(stale, predictions):
            entry.tokens, entry.version = tokens, version


def make_policy(config: SchedulerConfig, max_model_len: int) -> SchedulingPolicy:
    if config.scheduling_policy == "priority":
        return PriorityPolicy()
    if config.scheduling_policy == "sjf":
        return ShortestJobFirstPolicy(max_model_len, config.sjf_max_wait_s)
    return SchedulingPolicy()
