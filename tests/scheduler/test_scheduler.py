"""The scheduler against a fake model: budgets, FCFS, chunked prefill, preemption, freeing.

One-sequence requests; sequence groups (forks, swapping) are in test_scheduler_groups.py.
The fake engine step and its checks live in harness.py.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler.harness import (
    FAKE_TOKEN,
    add_all,
    assert_all_free,
    check_state,
    make_groups,
    make_scheduler,
    run_step,
    run_to_completion,
    sample_token,
    scheduled_ids,
    worker_of,
)

from serve.sequence import SequenceGroup, SequenceStatus

# -- add ------------------------------------------------------------------------------------


def test_add_refuses_empty_prompt():
    sched = make_scheduler()
    (group,) = make_groups([0])
    with pytest.raises(ValueError, match="empty"):
        sched.add(group)
    assert sched.num_unfinished == 0


@pytest.mark.parametrize("extra", [0, 1, 10])
def test_add_refuses_prompt_at_or_over_max_model_len(extra):
    sched = make_scheduler(max_model_len=32)
    (group,) = make_groups([32 + extra])
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(group)
    assert sched.num_unfinished == 0


def test_add_refuses_more_sequences_than_max_num_seqs():
    sched = make_scheduler(max_num_seqs=4)
    (group,) = make_groups([4], best_of=5)
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.add(group)
    assert sched.num_unfinished == 0


def test_prompt_one_short_of_max_model_len_runs_to_the_window():
    sched = make_scheduler(num_blocks=8, block_size=4, max_model_len=32)
    (group,) = add_all(sched, make_groups([31], max_tokens=100))
    run_to_completion(sched)
    (seq,) = group.seqs
    assert seq.num_output_tokens == 1 and seq.num_tokens == 32
    assert_all_free(sched)


# -- admission and order ----------------------------------------------------------------------


def test_fcfs_admission_under_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    groups = add_all(sched, make_groups([5, 6, 7, 8], max_tokens=2))
    out = run_step(sched)
    assert scheduled_ids(out) == [(0, 5), (1, 6)]
    assert list(sched.waiting) == groups[2:]
    out = run_step(sched)  # r0 and r1 finish with this decode
    assert scheduled_ids(out) == [(0, 1), (1, 1)]
    assert groups[0].is_finished and groups[1].is_finished
    out = run_step(sched)
    assert scheduled_ids(out) == [(2, 7), (3, 8)]
    run_to_completion(sched)
    assert_all_free(sched)


def test_fcfs_admission_under_token_budget():
    sched = make_scheduler(max_num_batched_tokens=25)
    groups = add_all(sched, make_groups([10, 10, 10, 10]))
    out = run_step(sched)
    # r2 gets the budget's remainder as a first chunk; r3 waits its turn.
    assert scheduled_ids(out) == [(0, 10), (1, 10), (2, 5)]
    assert list(sched.waiting) == groups[3:]


def test_head_of_line_blocks_later_arrivals_that_would_fit():
    # 8 blocks of 4: r0 holds 5, r1 needs 4 and must wait; r2 (1 block) may not jump it.
    sched = make_scheduler(num_blocks=8, block_size=4, max_model_len=32)
    r0, r1, r2 = add_all(sched, make_groups([20, 16, 4], max_tokens=8))
    out = run_step(sched)
    assert scheduled_ids(out) == [(0, 20)]
    assert list(sched.waiting) == [r1, r2]
    while not r0.is_finished:
        out = run_step(sched)
        assert [s.seq_id for s in out.scheduled] == [0]
    out = run_step(sched)
    assert scheduled_ids(out) == [(1, 16), (2, 4)]
    run_to_completion(sched)
    assert_all_free(sched)


def test_running_decodes_go_before_new_prompts():
    sched = make_scheduler(max_num_batched_tokens=16)
    add_all(sched, make_groups([4, 4], max_tokens=10))
    run_step(sched)
    (late,) = add_all(sched, make_groups([40], first_id=2))
    out = run_step(sched)
    assert scheduled_ids(out) == [(0, 1), (1, 1), (2, 14)]
    out = run_step(sched)
    assert scheduled_ids(out) == [(0, 1), (1, 1), (2, 14)]
    out = run_step(sched)
    assert scheduled_ids(out) == [(0, 1), (1, 1), (2, 12)]
    assert late.seqs[0].num_computed_tokens == 40


def test_new_prompt_waits_when_decodes_use_the_whole_budget():
    sched = make_scheduler(max_num_batched_tokens=2)
    add_all(sched, make_groups([1, 1], max_tokens=3))
    run_step(sched)
    (late,) = add_all(sched, make_groups([3], first_id=2))
    out = run_step(sched)
    assert scheduled_ids(out) == [(0, 1), (1, 1)]
    assert late.seqs[0].status is SequenceStatus.WAITING
    run_to_completion(sched)
    assert late.seqs[0].num_output_tokens == 4
    assert_all_free(sched)


# -- chunked prefill ----------------------------------------------------------------------------


def test_long_prompt_is_prefilled_in_chunks_and_only_the_last_samples():
    sched = make_scheduler(max_num_batched_tokens=8)
    (group,) = add_all(sched, make_groups([23], max_tokens=3))
    (seq,) = group.seqs
    chunks = []
    while seq.num_output_tokens == 0:
        out = run_step(sched)
        (s,) = out.scheduled
        chunks.append((s.num_new_tokens, seq.num_output_tokens == 1))
    assert chunks == [(8, False), (8, False), (7, True)]
    # Then one decode token per step.
    out = run_step(sched)
    assert scheduled_ids(out) == [(0, 1)] and out.scheduled[0].is_sampled
    assert seq.output_token_ids == [FAKE_TOKEN, FAKE_TOKEN]  # the worker's sampled tokens
    sched.abort_request(group.request_id)
    assert_all_free(sched)


def test_is_sampled_is_read_before_update():
    sched = make_scheduler(max_num_batched_tokens=8)
    (group,) = add_all(sched, make_groups([12]))
    (seq,) = group.seqs
    out = sched.schedule()
    assert [(s.num_new_tokens, s.is_sampled) for s in out.scheduled] == [(8, False)]
    assert seq.num_computed_tokens == 0  # the scheduler leaves it to update
    sched.update_from_output(out, worker_of(sched).execute(out))
    assert seq.num_computed_tokens == 8
    out = sched.schedule()
    assert [(s.num_new_tokens, s.is_sampled) for s in out.scheduled] == [(4, True)]


def test_chunks_grow_blocks_one_chunk_at_a_time():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=6)
    (group,) = add_all(sched, make_groups([20]))
    (seq,) = group.seqs
    for expected_blocks in (2, 3, 5, 5):  # ceil(6/4), ceil(12/4), ceil(18/4), ceil(20/4)
        run_step(sched)
        assert len(sched.block_manager.get_block_table(seq.seq_id)) == expected_blocks
    assert seq.num_output_tokens == 1


@pytest.mark.parametrize("budget", [1, 3, 16])
def test_chunked_prefill_finishes_every_sequence(budget):
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=budget)
    groups = add_all(sched, make_groups([1, 17, 30, 5, 9], max_tokens=5))
    outs = run_to_completion(sched)
    assert all(g.seqs[0].num_output_tokens == 5 for g in groups)
    assert all(o.num_batched_tokens <= budget for o in outs)
    assert_all_free(sched)


# -- preemption ---------------------------------------------------------------------------------


def test_preempts_the_latest_arrival_and_requeues_it_first():
    # 6 blocks of 4: three 8-token prompts fill the cache; the first decode needs a 7th block.
    sched = make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    r0, r1, r2 = add_all(sched, make_groups([8, 8, 8], max_tokens=5))
    (r3,) = add_all(sched, make_groups([2], first_id=3))
    out = run_step(sched)
    assert scheduled_ids(out) == [(0, 8), (1, 8), (2, 8)]
    assert sched.block_manager.num_free_blocks == 0
    out = run_step(sched)
    assert out.preempted_request_ids == [r2.request_id]
    assert scheduled_ids(out) == [(0, 1), (1, 1)]  # r2's two blocks went to r0 and r1
    (seq2,) = r2.seqs
    assert seq2.status is SequenceStatus.WAITING and seq2.num_computed_tokens == 0
    assert seq2.output_token_ids == [sample_token(seq2.seq_id)]  # recompute keeps the tokens
    assert list(sched.waiting) == [r2, r3]
    assert sched.num_preemptions == 1
    assert not sched.block_manager.has_table(seq2.seq_id)
    assert not out.blocks_to_swap_out  # one sequence: recomputed, not swapped
    run_to_completion(sched)
    assert all(g.seqs[0].num_output_tokens == 5 for g in (r0, r1, r2))
    assert_all_free(sched)


def test_preempted_sequence_recomputes_prompt_and_outputs_then_samples():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    r0, r1 = add_all(sched, make_groups([8, 8], max_tokens=6))
    run_step(sched)
    out = run_step(sched)
    assert out.preempted_request_ids == [r1.request_id]
    (seq,) = r1.seqs
    assert seq.num_tokens == 9  # 8 prompt + 1 sampled before the preemption
    while seq.status is SequenceStatus.WAITING:
        run_step(sched)
    # Readmitted: the whole prompt and its output token are recomputed, then it samples.
    assert seq.num_computed_tokens == 9 and seq.num_output_tokens == 2


def test_a_sequence_that_cannot_grow_preempts_itself():
    # r0's sampled token fits its last block; r1's needs a third block and none is free.
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    r0, r1 = add_all(sched, make_groups([7, 8], max_tokens=3))
    run_step(sched)
    out = run_step(sched)
    assert scheduled_ids(out) == [(0, 1)]
    assert out.preempted_request_ids == [r1.request_id]
    assert list(sched.waiting) == [r1] and sched.running == [r0]
    run_to_completion(sched)
    assert_all_free(sched)


def test_no_admission_in_a_step_that_preempts():
    sched = make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    add_all(sched, make_groups([8, 8, 8], max_tokens=5))
    run_step(sched)
    (small,) = add_all(sched, make_groups([1], first_id=3))
    out = run_step(sched)
    assert out.preempted_request_ids and small.seqs[0].status is SequenceStatus.WAITING
    assert small.seqs[0].seq_id not in [s.seq_id for s in out.scheduled]


def test_preemption_never_deadlocks_and_frees_everything():
    sched = make_scheduler(num_blocks=8, block_size=2, max_num_seqs=6, max_model_len=16)
    groups = add_all(sched, make_groups([3, 5, 2, 7, 4, 6, 1, 9], max_tokens=6))
    run_to_completion(sched, max_steps=500)
    assert sched.num_preemptions > 0
    assert all(g.seqs[0].num_output_tokens == 6 or g.seqs[0].num_tokens == 16 for g in groups)
    assert_all_free(sched)


def test_admission_keeps_a_watermark_beside_running_work():
    # 200 blocks of 1 token: the watermark is 2 blocks while anything runs.
    sched = make_scheduler(num_blocks=200, block_size=1, max_num_batched_tokens=512)
    assert sched.watermark_blocks == 2
    add_all(sched, make_groups([100], max_tokens=50))
    run_step(sched)
    (big,) = add_all(sched, make_groups([99], first_id=1))
    run_step(sched)  # 99 free, 99 needed + 2 watermark: wait
    assert big.seqs[0].status is SequenceStatus.WAITING
    sched.abort_request(sched.running[0].request_id)
    run_step(sched)
    assert big.seqs[0].status is SequenceStatus.RUNNING


def test_admission_with_nothing_running_may_use_the_whole_cache():
    sched = make_scheduler(num_blocks=200, block_size=1, max_num_batched_tokens=512)
    (group,) = add_all(sched, make_groups([199], max_tokens=1))
    out = run_step(sched)
    assert scheduled_ids(out) == [(0, 199)] and group.is_finished
    assert_all_free(sched)


# -- finish ---------------------------------------------------------------------------------------


def test_finish_running_sequence_frees_its_blocks_at_once():
    sched = make_scheduler(num_blocks=16, block_size=4)
    r0, r1 = add_all(sched, make_groups([10, 6], max_tokens=10))
    run_step(sched)
    assert sched.block_manager.num_free_blocks == 16 - 3 - 2
    sched.abort_request(r0.request_id)
    assert r0.is_finished and r0 not in sched.running
    assert not sched.block_manager.has_table(r0.seqs[0].seq_id)
    assert sched.block_manager.num_free_blocks == 16 - 2
    check_state(sched)
    out = run_step(sched)
    assert scheduled_ids(out) == [(1, 1)]
    sched.abort_request(r1.request_id)
    assert_all_free(sched)


def test_finish_waiting_sequence_removes_it():
    sched = make_scheduler(max_num_seqs=1)
    r0, r1, r2 = add_all(sched, make_groups([4, 4, 4], max_tokens=3))
    run_step(sched)
    sched.abort_request(r1.request_id)
    assert r1.is_finished and list(sched.waiting) == [r2]
    check_state(sched)
    run_to_completion(sched)
    assert r1.seqs[0].num_output_tokens == 0 and r2.seqs[0].num_output_tokens == 3
    assert_all_free(sched)


def test_finish_preempted_sequence_frees_nothing_twice():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    r0, r1 = add_all(sched, make_groups([8, 8], max_tokens=6))
    run_step(sched)
    out = run_step(sched)
    assert out.preempted_request_ids == [r1.request_id]
    sched.abort_request(r1.request_id)  # aborted while waiting to be recomputed
    check_state(sched)
    sched.abort_request(r0.request_id)
    assert_all_free(sched)


def test_finish_mid_chunked_prefill_frees_its_blocks():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    (group,) = add_all(sched, make_groups([30]))
    run_step(sched)
    (seq,) = group.seqs
    assert seq.num_computed_tokens == 8 and seq.num_output_tokens == 0
    sched.abort_request(group.request_id)
    assert_all_free(sched)


# -- random workloads ---------------------------------------------------------------------------


def expected_num_output_tokens(group: SequenceGroup, max_model_len: int) -> int:
    seq = group.seqs[0]
    return min(seq.sampling_params.max_tokens, max_model_len - seq.num_prompt_tokens)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_with_a_tiny_cache(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(4, 12) * (8 // block_size)
    max_model_len = num_blocks * block_size
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(2, 16),
        max_num_batched_tokens=rng.randint(4, 64),
        max_model_len=max_model_len,
    )
    groups = []
    for seq_id in range(60):
        prompt_len = rng.randint(1, max_model_len // 2)
        (group,) = make_groups([prompt_len], max_tokens=rng.randint(1, 24), first_id=seq_id)
        sched.add(group)
        groups.append(group)
    run_to_completion(sched, max_steps=20_000)
    for group in groups:
        assert group.is_finished
        assert group.seqs[0].num_output_tokens == expected_num_output_tokens(group, max_model_len)
    assert sched.num_preemptions > 0
    assert_all_free(sched)


@settings(max_examples=100, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(2, 24),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 24),
    chunked=st.booleans(),
    data=st.data(),
)
def test_random_arrivals_and_aborts(
    block_size, num_blocks, max_num_seqs, max_num_batched_tokens, chunked, data
):
    max_model_len = data.draw(st.integers(2, num_blocks * block_size), label="max_model_len")
    if not chunked:  # as the engine requires
        max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
    sched = make_scheduler(
        num_blocks,
        block_size,
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        enable_chunked_prefill=chunked,
    )
    groups: list[SequenceGroup] = []
    aborted: set[int] = set()
    num_steps = data.draw(st.integers(0, 40), label="num_steps")
    for _ in range(num_steps):
        for _ in range(data.draw(st.integers(0, 2))):
            prompt_len = data.draw(st.integers(1, max_model_len - 1))
            max_tokens = data.draw(st.integers(1, 12))
            (group,) = make_groups([prompt_len], max_tokens=max_tokens, first_id=len(groups))
            sched.add(group)
            groups.append(group)
        live = [g for g in groups if not g.is_finished]
        if live and data.draw(st.booleans()):
            victim = data.draw(st.sampled_from(live))
            sched.abort_request(victim.request_id)
            aborted.add(id(victim))
            check_state(sched)
        if sched.num_unfinished:
            run_step(sched)
    run_to_completion(sched, max_steps=5_000)
    for group in groups:
        assert group.is_finished
        if id(group) not in aborted:
            assert group.seqs[0].num_output_tokens == expected_num_output_tokens(
                group, max_model_len
            )
    assert_all_free(sched)
