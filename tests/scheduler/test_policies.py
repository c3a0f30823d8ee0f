"""Who runs first under each --scheduling-policy: fcfs, priority (vLLM's semantics) and
sjf (shortest predicted output first, with a bound on any request's wait).

Pure Python: the fake worker of harness.py runs every step, and checks the scheduler's
invariants after each one, so the policies are also checked to keep budgets, decodes
first and block accounting."""

from __future__ import annotations

import pytest
from scheduler.harness import (
    add_all,
    assert_all_free,
    make_group,
    make_scheduler,
    prompt_of,
    run_step,
    run_to_completion,
)

from serve.scheduler.length_predictor import OutputLengthPredictor, prompt_features
from serve.scheduler.policy import ShortestJobFirstPolicy
from serve.scheduler.scheduler import Scheduler
from serve.sequence import SequenceGroup


def start_order(sched: Scheduler, groups: list[SequenceGroup]) -> list[str]:
    """Run every request to the end; their request ids in the order they first ran."""
    owner = {g.seqs[0].seq_id: g.request_id for g in groups}
    order: list[str] = []
    for out in run_to_completion(sched):
        for s in out.scheduled:
            request_id = owner.get(s.seq_id)
            if request_id is not None and request_id not in order:
                order.append(request_id)
    return order


# -- priority ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", ["r0", "r1", "r2", "r3", "r4"]), ("priority", ["r1", "r3", "r2", "r4", "r0"])],
)
def test_requests_start_by_priority_then_arrival(policy: str, expected: list[str]) -> None:
    sched = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
    priorities = [3, 1, 2, 1, 2]  # lower first, ties by arrival: r1 r3, then r2 r4, then r0
    groups = [
        make_group(i, prompt_of(i, 6), max_tokens=3, priority=p) for i, p in enumerate(priorities)
    ]
    add_all(sched, groups)
    assert start_order(sched, groups) == expected
    assert_all_free(sched)


def grow_until_preemption(sched: Scheduler) -> list[str]:
    for _ in range(200):
        out = run_step(sched)
        if out.preempted_request_ids:
            return out.preempted_request_ids
    raise AssertionError("the cache never ran short")


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "r2"), ("priority", "r1")])
def test_the_lowest_priority_running_request_is_preempted_first(policy: str, victim: str) -> None:
    # 3 requests share 12 blocks of 4 tokens and grow to 20 tokens each: the cache runs
    # short. fcfs preempts the latest arrival; priority the lowest priority (r1: 5).
    sched = make_scheduler(num_blocks=12, max_num_seqs=3, scheduling_policy=policy)
    groups = [
        make_group(i, prompt_of(i, 4), max_tokens=16, priority=p) for i, p in enumerate([0, 5, 1])
    ]
    add_all(sched, groups)
    assert grow_until_preemption(sched)[0] == victim
    run_to_completion(sched)
    assert_all_free(sched)


def test_a_waiting_high_priority_request_takes_a_seat_from_a_lower_one() -> None:
    sched = make_scheduler(max_num_seqs=2, scheduling_policy="priority")
    low = add_all(sched, [make_group(i, prompt_of(i, 4), 20, priority=5) for i in range(2)])
    for _ in range(3):
        run_step(sched)
    assert all(g in sched.running for g in low)
    # Equal priority waits its turn: no preemption.
    peer = make_group(2, prompt_of(2, 4), 4, priority=5)
    sched.add(peer)
    out = run_step(sched)
    assert not out.preempted_request_ids and peer in sched.waiting
    high = make_group(3, prompt_of(3, 4), 4, priority=0)
    sched.add(high)
    out = run_step(sched)
    assert out.preempted_request_ids == ["r1"]  # the later of the two low ones
    assert high.seqs[0].seq_id in {s.seq_id for s in out.scheduled}
    run_to_completion(sched)
    assert_all_free(sched)


def test_a_waiting_high_priority_request_takes_blocks_from_a_lower_one() -> None:
    # Seats to spare, but the low-priority request holds nearly every block.
    sched = make_scheduler(num_blocks=10, max_num_seqs=4, scheduling_policy="priority")
    low = make_group(0, prompt_of(0, 30), max_tokens=8, priority=9)
    sched.add(low)
    run_step(sched)
    assert sched.block_manager.num_free_blocks < 3
    high = make_group(1, prompt_of(1, 10), max_tokens=2, priority=0)
    sched.add(high)
    out = run_step(sched)
    assert out.preempted_request_ids == ["r0"]
    assert high.seqs[0].seq_id in {s.seq_id for s in out.scheduled}
    run_to_completion(sched)
    assert_all_free(sched)


def test_the_lowest_priority_group_is_swapped_out_and_finishes_last() -> None:
    # Beam groups swap when preempted: three of them outgrow 16 blocks together.
    sched = make_scheduler(
        num_blocks=16, num_cpu_blocks=32, max_num_seqs=6, scheduling_policy="priority"
    )
    groups = [
        make_group(i, prompt_of(i, 4), max_tokens=10, beam_width=2, priority=p)
        for i, p in enumerate([2, 1, 3])
    ]
    add_all(sched, groups)
    finished: list[str] = []
    swapped: set[str] = set()
    while sched.has_unfinished_requests():
        run_step(sched)
        swapped.update(g.request_id for g in sched.swapped)
        finished += [g.request_id for g in groups if g.is_finished and g.request_id not in finished]
    assert swapped == {"r2"}
    assert finished[-1] == "r2"
    assert_all_free(sched)


# -- shortest job first --------------------------------------------------------------------

SHORT, LONG = 2, 40  # output tokens (the fake worker never samples EOS: max_tokens)


def short_prompt(i: int) -> list[int]:
    return [11, 12, 13, 500 + i]


def long_prompt(i: int) -> list[int]:
    return [21, 22, 23, 500 + i]


def sjf_scheduler(max_wait_s: float, clock, trained: bool = True, max_num_seqs: int = 1):
    sched = make_scheduler(
        max_num_seqs=max_num_seqs,
        scheduling_policy="sjf",
        sjf_max_wait_s=max_wait_s,
        clock=clock,
    )
    policy = ShortestJobFirstPolicy(
        sched.max_model_len, max_wait_s, OutputLengthPredictor(background=False)
    )
    sched.policy = policy
    if trained:  # what this server saw before (a predictor test covers what it learns from)
        for i in range(40):
            prompt, length = (short_prompt(i), SHORT) if i % 2 else (long_prompt(i), LONG)
            policy.predictor.observe(prompt_features(prompt, length), None, length)
        assert policy.predictor.is_active
    return sched


def job(seq_id: int, prompt: list[int], length: int, arrival: float) -> SequenceGroup:
    group = make_group(seq_id, prompt, max_tokens=length)
    group.arrival_time = group.seqs[0].arrival_time = arrival
    return group


def long_and_short_jobs() -> list[SequenceGroup]:
    """Long, short, long, short, one second apart."""
    return [
        job(i, (short_prompt if i % 2 else long_prompt)(i), SHORT if i % 2 else LONG, float(i))
        for i in range(4)
    ]


def test_sjf_is_fcfs_while_the_predictor_is_cold() -> None:
    sched = sjf_scheduler(30.0, lambda: 0.0, trained=False)
    groups = add_all(sched, long_and_short_jobs())
    assert start_order(sched, groups) == ["r0", "r1", "r2", "r3"]
    assert_all_free(sched)


def test_sjf_runs_shorter_predicted_jobs_first() -> None:
    sched = sjf_scheduler(30.0, lambda: 0.0)
    groups = add_all(sched, long_and_short_jobs())
    assert start_order(sched, groups) == ["r1", "r3", "r0", "r2"]
    # Each finished request taught the predictor, which reports its error.
    error = sched.policy.predictor_error
    assert error is not None and error < (LONG - SHORT) / 2
    assert_all_free(sched)


def test_sjf_ranks_a_capped_long_prompt_by_its_cap() -> None:
    """A long-class prompt capped at 3 tokens ranks as a 3-token job: after the short job,
    ahead of the uncapped long one that came first (a prediction of ~LONG would have put
    it after that one)."""
    sched = sjf_scheduler(30.0, lambda: 0.0)
    groups = add_all(
        sched,
        [
            job(0, long_prompt(0), LONG, 0.0),
            job(1, long_prompt(1), 3, 1.0),
            job(2, short_prompt(2), SHORT, 2.0),
        ],
    )
    assert start_order(sched, groups) == ["r2", "r1", "r0"]
    assert_all_free(sched)


@pytest.mark.parametrize("max_wait_s", [10.0, 1000.0])
def test_a_request_that_always_loses_on_rank_is_passed_over_no_longer_than_the_bound(
    max_wait_s: float,
) -> None:
    """One step is one second. A short request arrives every step, so a long one always
    ranks behind some short one; only the bound lets it start. What the bound counts is
    the time it waits while a later arrival runs; once it runs, it is ahead of them all."""
    now = [0.0]
    sched = sjf_scheduler(max_wait_s, lambda: now[0])
    long = job(1, long_prompt(1), LONG, 0.0)
    arrivals = {0: 0.0, 1: 0.0}  # seq id -> arrival
    add_all(sched, [job(0, short_prompt(0), SHORT, 0.0), long])
    passed_over, ran = 0.0, []
    for step in range(60):
        arrivals[step + 2] = now[0]
        sched.add(job(step + 2, short_prompt(step + 2), SHORT, now[0]))
        out = run_step(sched)
        if _ran(out, long):
            ran.append(step)
        elif not ran and max(arrivals[s.seq_id] for s in out.scheduled) > 0.0:
            passed_over += 1.0  # a later arrival ran this second while it waited
        now[0] += 1.0
    if max_wait_s == 1000.0:
        assert not ran  # without a bound in reach it starves: the test can fail
        return
    # Shorter jobs went first; it was passed over for the bound, plus at most the rest of
    # a short job's run (2 steps: its prompt, then its last token) that began before.
    assert max_wait_s <= passed_over <= max_wait_s + 2.0
    assert sched.policy.longest_passed_over_s == passed_over  # what /metrics shows
    # Then no short job preempted it: it ran every step to its end.
    assert len(ran) == LONG and ran == list(range(ran[0], ran[0] + LONG))
    assert long.is_finished


def test_sjf_time_behind_earlier_arrivals_does_not_count_toward_the_bound() -> None:
    """One seat, a 10 s bound. A second long request waits 20 s behind the first, the
    queueing fcfs would have too, so a short one arriving then still goes first, and takes
    the first one's seat. (A bound on plain age would have put both long requests ahead
    of it: the queue served in arrival order just when it is longest.)"""
    now = [0.0]
    sched = sjf_scheduler(10.0, lambda: now[0])
    first, second = job(0, long_prompt(0), LONG, 0.0), job(1, long_prompt(1), LONG, 1.0)
    sched.add(first)
    for step in range(21):
        if step == 1:
            sched.add(second)
        assert _ran(run_step(sched), first)
        now[0] += 1.0
    assert sched.policy.longest_passed_over_s == 0.0
    short = job(2, short_prompt(2), SHORT, now[0])
    sched.add(short)
    out = run_step(sched)
    assert out.preempted_request_ids == ["r0"] and _ran(out, short)
    assert second in sched.waiting and first in sched.waiting
    run_to_completion(sched)
    assert all(g.is_finished for g in (first, second, short))
    assert_all_free(sched)


def _ran(out, group: SequenceGroup) -> bool:
    return group.seqs[0].seq_id in {s.seq_id for s in out.scheduled}


def test_sjf_a_waiting_short_job_takes_the_seat_of_a_running_long_one() -> None:
    """Shortest remaining first: one seat, a long job running, a short one arrives. The
    long one yields; a second long one arriving does not make it yield (no thrashing
    between near-equals); both long ones finish after the short one."""
    sched = sjf_scheduler(30.0, lambda: 0.0)
    long = add_all(sched, [job(0, long_prompt(0), LONG, 0.0)])[0]
    for _ in range(3):
        run_step(sched)
    peer = job(1, long_prompt(1), LONG, 0.0)
    sched.add(peer)
    out = run_step(sched)
    assert not out.preempted_request_ids and _ran(out, long) and peer in sched.waiting
    short = job(2, short_prompt(2), SHORT, 0.0)
    sched.add(short)
    out = run_step(sched)
    assert out.preempted_request_ids == ["r0"] and _ran(out, short)
    finished: list[str] = []
    while sched.has_unfinished_requests():
        run_step(sched)
        finished += [
            g.request_id
            for g in (long, peer, short)
            if g.is_finished and g.request_id not in finished
        ]
    assert finished == ["r2", "r0", "r1"]
    # The preempted job kept its tokens: it ends with all of them.
    assert long.seqs[0].num_output_tokens == LONG
    assert_all_free(sched)


def test_sjf_preempts_no_one_while_cold() -> None:
    cold = sjf_scheduler(10.0, lambda: 0.0, trained=False)
    add_all(cold, [job(0, long_prompt(0), LONG, 0.0)])
    run_step(cold)
    cold.add(job(1, short_prompt(1), SHORT, 0.0))
    assert not run_step(cold).preempted_request_ids  # nothing predicted: fcfs
