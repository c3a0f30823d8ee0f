"""Step composition: running decodes first, then prefill chunks, then admissions; and
the same scheduler with chunked prefill off, where a prompt is only scheduled whole.

The harness (harness.py) checks after every step that decodes were listed first and
none was left out while other work ran, that budgets held, and, with chunking off, that
no prompt was split.
"""

from __future__ import annotations

import random

import pytest
from scheduler.harness import (
    add_all,
    assert_all_free,
    make_groups,
    make_scheduler,
    run_step,
    run_to_completion,
    scheduled_ids,
)

from serve.sequence import SequenceGroup, SequenceStatus
from serve.step import SchedulerOutput

NUM_DECODING = 16
LONG_PROMPT = 200


def start_decoding(sched, first_id: int, max_tokens: int) -> list[SequenceGroup]:
    """NUM_DECODING one-token prompts, admitted in one step and decoding from the next."""
    groups = add_all(sched, make_groups([1] * NUM_DECODING, max_tokens, first_id=first_id))
    out = run_step(sched)
    assert [n for _, n in scheduled_ids(out)] == [1] * NUM_DECODING
    return groups


def decode_ids(out: SchedulerOutput) -> list[int]:
    return [s.seq_id for s in out.scheduled if s.num_new_tokens == 1]


# -- chunking on -------------------------------------------------------------------------------


def test_decodes_go_before_an_older_requests_prefill_chunk():
    # r0 arrived first but joins the scheduler after r1 and r2 started decoding (as a
    # request whose grammar compiles late does): arrival order puts it first in `running`.
    sched = make_scheduler(max_num_batched_tokens=16)
    add_all(sched, make_groups([4, 4], max_tokens=10, first_id=1))
    run_step(sched)
    (old,) = add_all(sched, make_groups([40], first_id=0))
    out = run_step(sched)
    assert scheduled_ids(out) == [(1, 1), (2, 1), (0, 14)]
    assert sched.running[0] is old
    out = run_step(sched)
    assert scheduled_ids(out) == [(1, 1), (2, 1), (0, 14)]
    out = run_step(sched)
    assert scheduled_ids(out) == [(1, 1), (2, 1), (0, 12)]
    assert old.seqs[0].num_output_tokens == 1
    run_to_completion(sched)
    assert_all_free(sched)


@pytest.mark.parametrize("long_arrives", ["after", "before"])
@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("budget", [20, 50, 64])
def test_a_long_prompt_never_holds_up_sixteen_decodes(budget, block_size, long_arrives):
    """Every step of the long prefill carries all 16 decodes, one token each, and the
    prompt's chunk takes the rest of the budget (chunk boundaries fall mid-block)."""
    chunk = budget - NUM_DECODING
    num_chunks = -(-LONG_PROMPT // chunk)
    sched = make_scheduler(
        num_blocks=4096 // block_size,
        block_size=block_size,
        max_num_seqs=NUM_DECODING + 1,
        max_num_batched_tokens=budget,
    )
    long_id = NUM_DECODING + 1 if long_arrives == "after" else 0
    decoding = start_decoding(sched, first_id=1, max_tokens=num_chunks + 8)
    (long,) = add_all(sched, make_groups([LONG_PROMPT], max_tokens=2, first_id=long_id))
    (seq,) = long.seqs
    chunks = []
    while seq.num_output_tokens == 0:
        out = run_step(sched)
        assert decode_ids(out) == [g.seqs[0].seq_id for g in decoding]
        assert out.scheduled[-1].seq_id == seq.seq_id and len(out.scheduled) == NUM_DECODING + 1
        assert out.num_batched_tokens <= budget
        chunks.append(out.scheduled[-1].num_new_tokens)
    assert chunks == [chunk] * (num_chunks - 1) + [LONG_PROMPT - chunk * (num_chunks - 1)]
    assert all(not g.is_finished for g in decoding)  # they decoded all along
    run_to_completion(sched)
    assert_all_free(sched)


def test_new_admissions_take_first_chunks_after_running_prefills():
    sched = make_scheduler(max_num_batched_tokens=16)
    add_all(sched, make_groups([2], max_tokens=10))
    run_step(sched)
    add_all(sched, make_groups([20, 30], first_id=1))
    out = run_step(sched)  # the decode, r1's first chunk; r2 waits
    assert scheduled_ids(out) == [(0, 1), (1, 15)]
    out = run_step(sched)  # the decode, r1's last chunk, then r2's first
    assert scheduled_ids(out) == [(0, 1), (1, 5), (2, 10)]
    out = run_step(sched)  # two decodes, then r2's next chunk
    assert scheduled_ids(out) == [(0, 1), (1, 1), (2, 14)]
    run_to_completion(sched)
    assert_all_free(sched)


# -- chunking off ------------------------------------------------------------------------------


def unchunked(**kwargs):
    kwargs.setdefault("max_model_len", kwargs["max_num_batched_tokens"])
    return make_scheduler(enable_chunked_prefill=False, **kwargs)


def test_unchunked_prompts_are_admitted_whole_fcfs():
    sched = unchunked(num_blocks=16, block_size=4, max_num_batched_tokens=25)
    groups = add_all(sched, make_groups([10, 10, 10, 2]))
    out = run_step(sched)
    # r2 does not fit the 5 tokens left and is not split; r3 would fit but waits its turn.
    assert scheduled_ids(out) == [(0, 10), (1, 10)]
    assert list(sched.waiting) == groups[2:]
    out = run_step(sched)
    assert scheduled_ids(out) == [(0, 1), (1, 1), (2, 10), (3, 2)]
    run_to_completion(sched)
    assert_all_free(sched)


def test_unchunked_long_prompt_waits_until_the_budget_fits_it_whole():
    """Decodes still go first; the 245-token prompt runs, whole, in the first step whose
    decodes leave it room (at most 11 of 256 tokens), and holds up the later request."""
    budget, prompt_len = 256, 245
    sched = unchunked(num_blocks=512, block_size=8, max_num_seqs=32, max_num_batched_tokens=budget)
    # Staggered lengths: one decoding request finishes every step from the 3rd on.
    decoding: list[SequenceGroup] = []
    for i in range(NUM_DECODING):
        decoding += add_all(sched, make_groups([3], max_tokens=3 + i, first_id=i))
    run_step(sched)
    long, short = add_all(sched, make_groups([prompt_len, 2], first_id=NUM_DECODING))
    (seq,) = long.seqs
    while seq.status is SequenceStatus.WAITING:
        running = [g.seqs[0].seq_id for g in sched.running]
        out = run_step(sched)
        assert decode_ids(out) == running  # every running decode, every step
        if seq.status is SequenceStatus.WAITING:
            assert len(running) + prompt_len > budget
            assert short.seqs[0].status is SequenceStatus.WAITING  # FCFS
    assert len(running) + prompt_len <= budget < len(running) + 1 + prompt_len
    assert scheduled_ids(out)[-1] == (seq.seq_id, prompt_len)
    assert seq.num_output_tokens == 1
    run_to_completion(sched)
    assert_all_free(sched)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unchunked_random_workload(seed):
    # A budget a little over max_model_len and a cache of a few times that: both bind.
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    max_model_len = rng.randint(16, 48)
    sched = unchunked(
        num_blocks=-(-rng.randint(max_model_len, 3 * max_model_len) // block_size),
        block_size=block_size,
        max_num_seqs=rng.randint(2, 16),
        max_num_batched_tokens=max_model_len + rng.randint(0, 16),
        max_model_len=max_model_len,
    )
    groups = []
    for seq_id in range(60):
        prompt_len = rng.randint(1, max_model_len - 1)
        (group,) = make_groups([prompt_len], max_tokens=rng.randint(1, 24), first_id=seq_id)
        sched.add(group)
        groups.append(group)
    run_to_completion(sched, max_steps=20_000)
    for group in groups:
        (seq,) = group.seqs
        assert seq.num_output_tokens == min(
            seq.sampling_params.max_tokens, max_model_len - seq.num_prompt_tokens
        )
    assert sched.num_preemptions > 0
    assert_all_free(sched)
