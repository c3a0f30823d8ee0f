"""What the scheduler counts per request and per step for /metrics: a request's prompt
tokens found in the prefix cache and its preemptions (on every message it sends), and the
tokens each step ran (vLLM's num_cached_tokens, request_num_preemptions and
iteration_tokens_total)."""

from __future__ import annotations

from scheduler.harness import (
    add_all,
    make_group,
    make_groups,
    make_scheduler,
    prompt_of,
    run_step_with_deltas,
)

from serve.outputs import ITERATION_TOKENS_BUCKETS
from serve.scheduler.output_deltas import RequestDelta


def _run_all(sched) -> tuple[list[int], list[RequestDelta]]:
    """Every step's scheduled tokens and every message, until no request is left."""
    tokens, deltas = [], []
    while sched.has_unfinished_requests():
        out, step_deltas = run_step_with_deltas(sched)
        if out.scheduled:
            tokens.append(out.num_batched_tokens)
        deltas += step_deltas
        assert len(tokens) < 1000
    return tokens, deltas


def _by_request(deltas: list[RequestDelta]) -> dict[str, list[RequestDelta]]:
    by_request: dict[str, list[RequestDelta]] = {}
    for d in deltas:
        by_request.setdefault(d.request_id, []).append(d)
    return by_request


def test_every_message_carries_the_prompt_tokens_found_in_the_prefix_cache():
    sched = make_scheduler(block_size=4)
    prompt = prompt_of(0, 10)
    add_all(sched, [make_group(0, prompt)])
    _, deltas = _run_all(sched)
    assert {d.num_cached_tokens for d in deltas} == {0}  # nothing cached yet
    hits_before = sched.block_manager.prefix_cache.hits
    add_all(sched, [make_group(1, prompt)])  # the same prompt: its first 2 blocks hit
    _, deltas = _run_all(sched)
    assert deltas and {d.num_cached_tokens for d in deltas} == {8}
    assert sched.block_manager.prefix_cache.hits - hits_before == 8


def test_every_message_carries_the_times_its_request_was_preempted():
    # 6 blocks of 4: three 8-token prompts fill the cache; the first decode preempts r2.
    sched = make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    add_all(sched, make_groups([8, 8, 8], max_tokens=5))
    _, deltas = _run_all(sched)
    by_request = _by_request(deltas)
    assert sched.num_preemptions >= 1
    finals = {request_id: d[-1] for request_id, d in by_request.items()}
    assert all(d.finished for d in finals.values())
    assert sum(d.num_preemptions for d in finals.values()) == sched.num_preemptions
    assert finals["r2"].num_preemptions >= 1 and finals["r0"].num_preemptions == 0
    # A count only grows, message by message.
    for messages in by_request.values():
        counts = [d.num_preemptions for d in messages]
        assert counts == sorted(counts)


def test_each_step_observes_the_tokens_it_ran():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=16)
    add_all(sched, make_groups([10, 20, 3], max_tokens=4))
    tokens, _ = _run_all(sched)
    h = sched.iteration_tokens
    assert h.bounds == ITERATION_TOKENS_BUCKETS
    assert h.count == len(tokens) and h.total == sum(tokens)
    # 33 prompt tokens, and each request's 3 sampled tokens fed back (not its last).
    assert sum(tokens) == 33 + 3 * 3
    assert max(tokens) == 16  # the budget, filled by chunks
    assert h.cumulative(16.0)[-2] == (16.0, len(tokens))  # no step ran more
