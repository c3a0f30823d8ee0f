"""The scheduler's half of speculative decoding, with the fake worker proposing a random
number of tokens into the room it is given and accepting a random number of them: every
invariant of harness.run_step holds after every step (each sequence's blocks hold exactly
its computed tokens, the mirror equals the scheduler), rejected proposals' slots are
rolled back and their blocks returned."""

from __future__ import annotations

import random

from scheduler.harness import (
    FAKE_TOKEN,
    FIRST_SCHEDULER_SEQ_ID,
    PROPOSAL_TOKEN,
    add_all,
    make_group,
    make_groups,
    make_scheduler,
    prompt_of,
    run_step,
    run_step_with_deltas,
    worker_of,
)

from serve.config import SpeculativeMethod
from serve.scheduler.scheduler import Scheduler

NGRAM = SpeculativeMethod("ngram", num_speculative_tokens=3)


def run_to_end(sched: Scheduler) -> list:
    outs = []
    for _ in range(500):
        if not sched.has_unfinished_requests():
            return outs
        outs.append(run_step(sched))
    raise AssertionError("the requests did not finish")


def test_speculating_requests_under_preemption_end_with_their_lengths_and_free_every_block():
    rng = random.Random(3)
    sched = make_scheduler(
        num_blocks=12, block_size=4, max_num_batched_tokens=16, num_cpu_blocks=16, speculation=NGRAM
    )
    groups = add_all(sched, make_groups([rng.randint(2, 14) for _ in range(8)], max_tokens=12))
    groups.append(make_group(8, prompt_of(0, 14), max_tokens=12))  # a prefix-cache hit
    groups.append(make_group(9, prompt_of(9, 5), max_tokens=10, best_of=2))  # swapped
    for group in groups[8:]:
        sched.add(group)
    outs = run_to_end(sched)
    assert sched.num_preemptions > 0 and any(out.blocks_to_swap_out for out in outs)
    assert any(s.num_spec_tokens for out in outs for s in out.scheduled)
    spec = sched.spec_decode
    assert spec is not None and 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    for group in groups:
        assert all(
            len(seq.output_token_ids) == group.sampling_params.max_tokens for seq in group.seqs
        )
    accepted = [
        t
        for g in groups
        for s in g.seqs
        for t in s.output_token_ids
        if PROPOSAL_TOKEN <= t < FAKE_TOKEN + FIRST_SCHEDULER_SEQ_ID
    ]
    assert len(accepted) == spec.num_accepted_tokens  # no accepted proposal was lost
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_room_for_proposals_stops_short_of_max_tokens_and_is_not_scheduled_past():
    sched = make_scheduler(speculation=NGRAM)
    (group,) = add_all(sched, make_groups([5], max_tokens=3))
    run_step(sched)  # the prompt, and the first token
    out = sched.schedule()
    (s,) = out.scheduled
    # 1 token out; the step gives up to 1 + room tokens, and 3 is the most: room 1.
    assert s.num_spec_tokens == 1 and s.num_new_tokens == 2
    assert out.next_waits_for_output


def test_no_room_in_a_step_with_more_running_sequences_than_disable_by_batch_size():
    spec = SpeculativeMethod("ngram", num_speculative_tokens=2, disable_by_batch_size=2)
    sched = make_scheduler(speculation=spec)
    add_all(sched, make_groups([3, 3, 3, 3], max_tokens=4))
    add_all(sched, make_groups([3], max_tokens=40, first_id=4))
    steps = []
    while sched.has_unfinished_requests():
        running = sum(g.num_live_seqs for g in sched.running)
        steps.append((running, run_step(sched).speculates))
    assert all(not speculates for running, speculates in steps if running > 2)
    assert any(speculates for running, speculates in steps if running <= 2)


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there():
    sched = make_scheduler(speculation=NGRAM)
    worker = worker_of(sched)
    group = make_group(0, prompt_of(0, 4), max_tokens=30)
    add_all(sched, [group])
    run_step(sched)
    # The worker's next proposals will be these; the second is a stop token.
    worker.propose = lambda room: [PROPOSAL_TOKEN, PROPOSAL_TOKEN + 1, PROPOSAL_TOKEN + 2][:room]
    worker.rng.randint = lambda a, b: b  # every proposal accepted
    group.sampling_params.stop_token_ids = [PROPOSAL_TOKEN + 1]
    _, deltas = run_step_with_deltas(sched)
    (seq,) = group.seqs
    assert seq.output_token_ids[-2:] == [PROPOSAL_TOKEN, PROPOSAL_TOKEN + 1]
    assert seq.finish_reason is not None and seq.finish_reason.value == "stop"
    assert deltas[-1].finished
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
