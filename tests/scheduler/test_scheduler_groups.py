"""The scheduler with sequence groups: forks, copy-on-write, swap and recompute
preemption of multi-sequence groups, prefix-cache hits; the fake engine (harness.py)
checks after every step that each sequence's blocks hold its own tokens."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import pytest
from scheduler.harness import (
    add_all,
    assert_all_free,
    make_group,
    make_groups,
    make_scheduler,
    prompt_of,
    run_step,
    run_step_with_deltas,
    run_to_completion,
    sample_token,
    scheduled_ids,
)

from serve.scheduler.scheduler import Scheduler
from serve.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus
from serve.step import SchedulerOutput

# -- forks and copy-on-write ----------------------------------------------------------------


def test_a_group_forked_into_four_decodes_all_four_in_one_step():
    sched = make_scheduler(num_blocks=16, block_size=4)
    (group,) = add_all(sched, make_groups([6], max_tokens=3, best_of=4))
    out = run_step(sched)
    # The prompt's step names three forks; the worker samples the row once per sequence
    # and the scheduler adds the forks, sharing the prompt's blocks.
    assert scheduled_ids(out) == [(0, 6)] and out.scheduled[0].is_sampled
    fork_ids = out.scheduled[0].fork_seq_ids
    assert len(fork_ids) == 3 and out.forks_sequences
    assert [s.seq_id for s in group.seqs] == [0, *fork_ids]
    assert [s.output_token_ids for s in group.seqs] == [[sample_token(i)] for i in (0, *fork_ids)]
    bm = sched.block_manager
    assert bm.num_free_blocks == 16 - 2
    full, partial = bm.get_block_table(0)
    assert all(bm.block_pool.ref_count(b) == 4 for b in (full, partial))

    out = run_step(sched)
    assert scheduled_ids(out) == [(0, 1)] + [(i, 1) for i in fork_ids]
    assert all(s.is_sampled for s in out.scheduled) and not out.forks_sequences
    # Each writes token 6 into the shared partial block: three copy it, the last writes
    # in place; the full block is never copied.
    assert [src for src, _ in out.blocks_to_copy] == [partial] * 3
    assert bm.block_pool.ref_count(full) == 4 and bm.block_pool.ref_count(partial) == 1
    assert bm.num_free_blocks == 16 - 2 - 3
    # The copies reach the workers as table changes from the written block on.
    assert [(s.table_start, len(s.block_ids)) for s in out.scheduled] == [(1, 1)] * 3 + [(2, 0)]
    sched.abort_request(group.request_id)
    assert_all_free(sched)


def test_parallel_samples_share_the_prompt_blocks_and_finish():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=4)
    (group,) = add_all(sched, make_groups([16], max_tokens=5, best_of=4))
    run_step(sched)
    assert len(group.seqs) == 4
    assert sched.block_manager.num_free_blocks == 32 - 4  # the prompt, once
    outs = run_to_completion(sched)
    assert all(o.num_seqs == 4 for o in outs)
    assert all(s.num_output_tokens == 5 for s in group.seqs)
    assert_all_free(sched)


def test_a_group_counts_best_of_seats_from_admission():
    sched = make_scheduler(max_num_seqs=4)
    big, small = add_all(sched, [*make_groups([4], best_of=3), *make_groups([4], first_id=1)])
    late = add_all(sched, make_groups([4], first_id=2))
    out = run_step(sched)  # big holds 3 seats before forking; small takes the 4th
    assert scheduled_ids(out) == [(0, 4), (1, 4)]
    assert list(sched.waiting) == late
    out = run_step(sched)
    assert out.num_seqs == 4


def test_finishing_one_sequence_of_a_group_frees_only_its_blocks():
    sched = make_scheduler(num_blocks=16, block_size=4)
    (group,) = add_all(sched, make_groups([8], max_tokens=8, best_of=2))
    run_step(sched)
    run_step(sched)
    first, second = group.seqs
    num_free = sched.block_manager.num_free_blocks
    assert sched.stop_sequence(group.request_id, 1) is None  # its sibling runs on
    assert second.is_finished and group.live_seqs == [first]
    assert sched.block_manager.num_free_blocks == num_free + 1  # its own block only
    out = run_step(sched)
    assert scheduled_ids(out) == [(first.seq_id, 1)]
    run_to_completion(sched)
    assert_all_free(sched)


# -- preemption of multi-sequence groups --------------------------------------------------------


def squeeze(sched: Scheduler, best_of: int = 2) -> tuple[SequenceGroup, SequenceGroup]:
    """An early single-sequence request, then a `best_of` group that it will crowd out."""
    early, group = add_all(
        sched,
        [make_group(0, prompt_of(0, 8), max_tokens=12), make_group(1, prompt_of(1, 6), 6, best_of)],
    )
    return early, group


def run_until(sched: Scheduler, done: Callable[[], object]) -> list[SchedulerOutput]:
    outs = []
    while not done():
        outs.append(run_step(sched))
        assert len(outs) < 200
    return outs


def test_a_multi_sequence_group_is_swapped_out_and_back_before_new_work():
    sched = make_scheduler(num_blocks=8, block_size=4, max_model_len=24, num_cpu_blocks=8)
    early, group = squeeze(sched)
    outs = run_until(sched, lambda: sched.swapped)
    out = outs[-1]
    assert out.preempted_request_ids == [group.request_id] and sched.swapped == [group]
    assert len(out.blocks_to_swap_out) == sched.block_manager.num_swap_blocks(
        group.live_seqs, swapped_out=True
    )
    assert all(s.status is SequenceStatus.SWAPPED for s in group.seqs)
    assert all(sched.block_manager.is_swapped_out(s.seq_id) for s in group.seqs)
    computed = [s.num_computed_tokens for s in group.seqs]  # kept: nothing is recomputed
    (late,) = add_all(sched, make_groups([2], first_id=2))
    while sched.swapped:
        out = run_step(sched)
        assert late.seqs[0].status is SequenceStatus.WAITING or not sched.swapped
    assert out.blocks_to_swap_in
    assert [s.num_computed_tokens for s in group.seqs] == [c + 1 for c in computed]
    run_to_completion(sched)
    assert all(s.num_output_tokens == 6 for s in group.seqs)
    assert early.seqs[0].num_output_tokens == 12 and late.is_finished
    assert sched.num_preemptions >= 1
    assert_all_free(sched)


@pytest.mark.parametrize("enable_chunked_prefill", [True, False])
@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_recompute_mode_catches_up_then_samples_all_sequences_together(
    enable_prefix_caching, enable_chunked_prefill
):
    # With chunking off, each sequence's catch-up is scheduled whole (the harness checks).
    sched = make_scheduler(
        num_blocks=8,
        block_size=4,
        max_model_len=24,
        num_cpu_blocks=8,
        preemption_mode="recompute",
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    _, group = squeeze(sched)
    outs = run_until(sched, lambda: sched.num_preemptions)
    assert group in sched.waiting
    assert outs[-1].preempted_request_ids == [group.request_id] and not outs[-1].blocks_to_swap_out
    assert all(s.num_computed_tokens == 0 for s in group.seqs)
    counts = [s.num_output_tokens for s in group.seqs]
    # Readmitted, the sequences catch up on all but their last token, sampling nothing...
    caught_up = run_until(
        sched,
        lambda: group in sched.running and all(s.num_uncomputed_tokens == 1 for s in group.seqs),
    )
    assert caught_up and [s.num_output_tokens for s in group.seqs] == counts
    # ... then all sample in the same step.
    out = run_step(sched)
    assert {s.seq_id for s in out.scheduled} >= {s.seq_id for s in group.seqs}
    assert [s.num_output_tokens for s in group.seqs] == [c + 1 for c in counts]
    run_to_completion(sched)
    assert all(s.num_output_tokens == 6 for s in group.seqs)
    assert_all_free(sched)


def fewest_blocks(seqs: list[Sequence], block_size: int) -> int:
    """Blocks the sequences' computed tokens take at best: each distinct full-block prefix
    once (as forks leave them shared), and each sequence's partly filled last block."""
    full: set[tuple[int, ...]] = set()
    num_partial = 0
    for seq in seqs:
        tokens = seq.token_ids_between(0, seq.num_computed_tokens)
        num_full = len(tokens) // block_size
        full.update(tuple(tokens[: (i + 1) * block_size]) for i in range(num_full))
        num_partial += len(tokens) % block_size != 0
    return len(full) + num_partial


@pytest.mark.parametrize("enable_chunked_prefill", [True, False])
@pytest.mark.parametrize("enable_prefix_caching", [False, True])
@pytest.mark.parametrize("width", [{"best_of": 4}, {"beam_width": 4}], ids=["n", "beams"])
def test_a_recomputed_group_comes_back_sharing_its_prefixes(
    width, enable_prefix_caching, enable_chunked_prefill, caplog
):
    # 20 blocks; two groups of 4 sequences, each with a 6-block prompt and 8 output
    # tokens: 6 + 4 x 2 = 14 blocks alone, 28 together, so one is preempted and
    # recomputed. Its sequences came back unshared (4 x 8 = 32 blocks) and it was ended
    # short ("length") once alone; now they share their prompt again (and beams their
    # common output), as they did running.
    sched = make_scheduler(
        num_blocks=20,
        block_size=4,
        max_model_len=32,
        max_num_batched_tokens=32,
        preemption_mode="recompute",
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    groups = add_all(sched, [make_group(i, prompt_of(i, 24), 8, **width) for i in (0, 1)])
    bm = sched.block_manager
    finals, catching_up, num_caught_up = {}, set(), 0
    while sched.has_unfinished_requests():
        _, deltas = run_step_with_deltas(sched)
        finals.update((d.request_id, d) for d in deltas if d.finished)
        for group in sched.running:
            if any(s.num_uncomputed_tokens > 1 for s in group.live_seqs):
                catching_up.add(group.request_id)
            elif group.request_id in catching_up:
                # Caught up: it holds no more blocks than its tokens need, shared.
                held = {b for s in group.live_seqs for b in bm.get_block_table(s.seq_id)}
                assert len(held) == fewest_blocks(group.live_seqs, bm.block_size)
                catching_up.remove(group.request_id)
                num_caught_up += group.num_preemptions > 0
    assert "more KV blocks than the whole cache" not in caplog.text
    for group in groups:  # every sample, or every beam, reached max_tokens
        if "best_of" in width:
            assert [s.num_output_tokens for s in group.seqs] == [8] * 4
        else:
            assert [len(s.token_ids) for s in finals[group.request_id].seqs] == [8] * 4
    assert sched.num_preemptions and num_caught_up
    assert_all_free(sched)


def test_a_recomputed_sequence_starts_from_the_blocks_it_shares_with_one_caught_up():
    # 8 blocks, no prefix caching. Recomputed, the group's first sample catches up alone;
    # the second starts in a later step from the first's full prompt block (tokens 0-3),
    # computing only its own tokens after it. Both used to recompute from token 0 at once.
    sched = make_scheduler(
        num_blocks=8,
        block_size=4,
        max_model_len=24,
        preemption_mode="recompute",
        enable_prefix_caching=False,
    )
    _, group = squeeze(sched)
    run_until(sched, lambda: sched.num_preemptions)
    first, second = group.live_seqs
    bm = sched.block_manager
    outs = [run_step(sched)]
    while second.seq_id not in {s.seq_id for s in outs[-1].scheduled}:
        outs.append(run_step(sched))
        assert len(outs) < 100
    assert (first.seq_id, 10) in scheduled_ids(outs[-2])  # its catch-up: all but its last
    (started,) = [s for s in outs[-1].scheduled if s.seq_id in (first.seq_id, second.seq_id)]
    assert (started.seq_id, started.start, started.num_new_tokens) == (second.seq_id, 4, 6)
    (shared,) = bm.get_block_table(first.seq_id)[:1]
    assert bm.get_block_table(second.seq_id)[0] == shared and bm.block_pool.ref_count(shared) == 2
    run_to_completion(sched)
    assert all(s.num_output_tokens == 6 for s in group.seqs)
    assert_all_free(sched)


def test_swap_mode_swaps_a_single_sequence_too():
    sched = make_scheduler(
        num_blocks=6, block_size=4, max_model_len=24, num_cpu_blocks=8, preemption_mode="swap"
    )
    groups = add_all(sched, make_groups([8, 8, 8], max_tokens=5))
    run_step(sched)
    out = run_step(sched)
    assert out.preempted_request_ids == [groups[2].request_id] and out.blocks_to_swap_out
    assert sched.swapped == [groups[2]]
    run_to_completion(sched)
    assert_all_free(sched)


@pytest.mark.parametrize(("mode", "best_of"), [("swap", 1), ("swap", 2), (None, 2)])
def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_too_small(mode, best_of):
    sched = make_scheduler(
        num_blocks=6, block_size=4, max_model_len=24, num_cpu_blocks=1, preemption_mode=mode
    )
    _, group = squeeze(sched, best_of)
    outs = run_until(sched, lambda: sched.num_preemptions)
    assert outs[-1].preempted_request_ids == [group.request_id] and not outs[-1].blocks_to_swap_out
    assert group in sched.waiting and not sched.swapped
    assert all(s.num_computed_tokens == 0 for s in group.seqs)
    run_to_completion(sched)
    assert_all_free(sched)


# -- prefix caching ------------------------------------------------------------------------------


def test_a_prefix_cache_hit_lowers_the_first_steps_new_tokens():
    sched = make_scheduler(num_blocks=32, block_size=4)
    system = prompt_of(0, 8)
    add_all(sched, [make_group(0, system + [1, 2, 3], max_tokens=2)])
    run_to_completion(sched)
    # Same prompt: 8 of 11 tokens cached; shared system prompt: its 8 tokens cached.
    same, other = add_all(
        sched,
        [make_group(1, system + [1, 2, 3], 2), make_group(2, system + [4, 5, 6, 7, 8], 2)],
    )
    out = run_step(sched)
    assert scheduled_ids(out) == [(1, 3), (2, 5)]
    computed = [sched.get_seq(s.seq_id).num_computed_tokens for s in out.scheduled]
    assert computed == [11, 13]  # after update
    bm = sched.block_manager
    assert bm.get_block_table(1)[:2] == bm.get_block_table(2)[:2]
    assert (bm.prefix_cache.queries, bm.prefix_cache.hits) == (11 + 11 + 13, 16)
    run_to_completion(sched)
    assert_all_free(sched)


def test_a_prefix_ending_mid_block_hits_only_full_blocks():
    sched = make_scheduler(num_blocks=32, block_size=4)
    add_all(sched, [make_group(0, prompt_of(0, 10), max_tokens=1)])
    run_to_completion(sched)
    add_all(sched, [make_group(1, prompt_of(0, 6) + [1, 2, 3, 4], max_tokens=1)])
    out = run_step(sched)
    assert scheduled_ids(out) == [(1, 6)]


def test_prefix_hit_on_a_running_sequences_blocks():
    sched = make_scheduler(num_blocks=32, block_size=4)
    add_all(sched, [make_group(0, prompt_of(0, 9), max_tokens=10)])
    run_step(sched)
    add_all(sched, [make_group(1, prompt_of(0, 9), max_tokens=3)])
    out = run_step(sched)
    assert scheduled_ids(out) == [(0, 1), (1, 1)]
    bm = sched.block_manager
    assert bm.get_block_table(0)[:2] == bm.get_block_table(1)[:2]
    assert all(bm.block_pool.ref_count(b) == 2 for b in bm.get_block_table(0)[:2])
    run_to_completion(sched)
    assert_all_free(sched)


def test_disabled_prefix_caching_computes_the_whole_prompt():
    sched = make_scheduler(num_blocks=32, block_size=4, enable_prefix_caching=False)
    add_all(sched, [make_group(0, prompt_of(0, 9), max_tokens=1)])
    run_to_completion(sched)
    add_all(sched, [make_group(1, prompt_of(0, 9), max_tokens=1)])
    assert scheduled_ids(run_step(sched)) == [(1, 9)]


def test_recompute_reuses_the_preempted_sequences_cached_blocks():
    # 5 blocks: r1 (9 tokens) is preempted when r0 grows; r0's next block evicts r1's
    # tail, so r1 comes back with its first block cached and computes 9 - 4 tokens.
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=20)
    _, r1 = add_all(sched, make_groups([8, 8], max_tokens=6))
    run_step(sched)
    assert run_step(sched).preempted_request_ids == [r1.request_id]
    counters = replace(sched.block_manager.prefix_cache)
    outs = run_until(sched, lambda: r1.seqs[0].status is SequenceStatus.RUNNING)
    assert (r1.seqs[0].seq_id, 5) in scheduled_ids(outs[-1])
    # A return is no new lookup: the counters (vLLM's) hold each request's first alone.
    assert sched.block_manager.prefix_cache == counters
    run_to_completion(sched)
    assert_all_free(sched)


# -- capacity edge cases ----------------------------------------------------------------------


def test_a_group_that_cannot_grow_holding_the_whole_cache_is_given_up():
    # 4 blocks: two sequences of up to 16 tokens each need 1 shared + 2 x 3 blocks.
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, num_cpu_blocks=8)
    (group,) = add_all(sched, [make_group(0, prompt_of(0, 4), max_tokens=12, best_of=2)])
    (late,) = add_all(sched, make_groups([3], first_id=1))
    outs, deltas = [], []
    while not group.is_finished:
        out, step_deltas = run_step_with_deltas(sched)
        outs.append(out)
        deltas += step_deltas
        assert len(outs) < 200
    assert not outs[-1].preempted_request_ids
    assert not any(group.request_id in o.preempted_request_ids for o in outs)  # not forever
    assert all(s.num_tokens < 16 for s in group.seqs)
    assert all(s.finish_reason is FinishReason.LENGTH for s in group.seqs)
    deltas += run_step_with_deltas(sched)[1]  # the final message comes with the next update
    (final,) = [d for d in deltas if d.request_id == group.request_id and d.finished]
    run_to_completion(sched)
    assert late.seqs[0].num_output_tokens == 4
    assert_all_free(sched)


def test_a_swapped_group_that_fits_exactly_is_swapped_back_in():
    # 4 blocks. The 2-sequence group shares its 1-block prompt and has one block per
    # sequence (3 blocks); the early request's growth swaps it out. Alone again, the group
    # needs exactly its 3 blocks (each next token fits its own block), but the swap-in
    # check asks for 3 + 2.
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, num_cpu_blocks=8)
    add_all(sched, [make_group(0, prompt_of(0, 1), 8), make_group(1, prompt_of(1, 4), 6, 2)])
    run_to_completion(sched, max_steps=100)
    assert_all_free(sched)


def test_a_swapped_group_that_can_never_fit_again_is_given_up():
    # 4 blocks. Swapped out holding 3 (a shared block and one per sequence), each sequence's
    # next token needs a new block: 5 blocks, more than the cache, even once alone.
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, num_cpu_blocks=8)
    add_all(sched, [make_group(0, prompt_of(0, 1), 8), make_group(1, prompt_of(1, 5), 10, 2)])
    run_to_completion(sched, max_steps=100)
    assert_all_free(sched)


def test_a_recomputed_group_that_outgrows_the_cache_is_given_up_once_alone(caplog):
    # 8 blocks. Forked, the group holds its 2-block prompt once and a block per sequence
    # (6 blocks); the early request's growth preempts it. Recomputed, it comes back in
    # those 6 blocks, its sequences sharing the prompt again (unshared they needed 12, and
    # it was ended at once, after 4 tokens), and runs until, alone, its next 4 blocks do
    # not fit: 13 tokens, 5 of them output. It ends (cannot_fit), saying so in output
    # tokens, as the client counts them.
    sched = make_scheduler(
        num_blocks=8,
        block_size=4,
        max_model_len=32,
        max_num_seqs=5,
        preemption_mode="recompute",
        enable_prefix_caching=False,
    )
    early, group = add_all(
        sched, [make_group(0, prompt_of(0, 5), 12), make_group(1, prompt_of(1, 8), None, 4)]
    )
    run_to_completion(sched, max_steps=100)
    assert sched.num_preemptions == 1 and early.seqs[0].num_output_tokens == 12
    assert [s.num_output_tokens for s in group.seqs] == [5] * 4
    assert all(s.finish_reason is FinishReason.LENGTH for s in group.seqs)
    assert "(8); ending them after 5 output tokens" in caplog.text
    assert_all_free(sched)


@pytest.mark.parametrize("preemption_mode", [None, "swap", "recompute"])
def test_a_group_given_up_takes_no_one_with_it(preemption_mode):
    # 24 blocks. The first group's two samples outgrow the cache (2 x 22 blocks); each of
    # the three after it needs 12 at most. Ending the first, the step must not read its
    # still-held blocks with nothing running as "even an empty cache is too small" for the
    # swapped or recomputed groups waiting to come back: they fit once it is gone.
    sched = make_scheduler(
        num_blocks=24,
        block_size=4,
        max_model_len=96,
        num_cpu_blocks=96,
        preemption_mode=preemption_mode,
        enable_prefix_caching=False,
    )
    big = make_group(0, prompt_of(0, 8), 80, best_of=2)
    small = [make_group(i, prompt_of(i, 8), 20, best_of=2) for i in (1, 2, 3)]
    add_all(sched, [big, *small])
    run_to_completion(sched, max_steps=1000)
    assert all(s.num_output_tokens < 80 for s in big.seqs)  # given up
    for group in small:
        assert [s.num_output_tokens for s in group.seqs] == [20, 20], group.request_id
    assert_all_free(sched)


def test_a_group_wider_than_the_token_budget_is_refused_or_runs():
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=3)
    (wide,) = make_groups([4], best_of=4)
    with pytest.raises(ValueError, match="max_num_batched_tokens=3"):
        sched.add(wide)
    (fits,) = add_all(sched, make_groups([4], best_of=3, first_id=1))
    run_to_completion(sched, max_steps=100)
    assert [s.num_output_tokens for s in fits.seqs] == [4, 4, 4]
    assert_all_free(sched)


# -- random workloads -----------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
@pytest.mark.parametrize("seed", range(20))
def test_random_workload_with_forks_tiny_cache_and_swap_space(seed, chunked, caplog):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    max_best_of = 4
    max_model_len = rng.randint(4, 24)
    # Any one group fits with its sequences unshared, plus two blocks a sequence of
    # headroom: none is ever cut short.
    num_blocks = max_best_of * (-(-max_model_len // block_size) + 2) + rng.randint(0, 4)
    max_num_batched_tokens = rng.randint(max_best_of, 64)
    if not chunked:  # every prompt, recompute and catch-up must fit one step
        max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(max_best_of, 24),
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        num_cpu_blocks=rng.choice([0, 2, num_blocks // 2, 2 * num_blocks]),
        preemption_mode=rng.choice([None, "swap", "recompute"]),
        enable_prefix_caching=rng.random() < 0.8,
        enable_chunked_prefill=chunked,
    )
    groups = []
    shared = [rng.randrange(50) for _ in range(max_model_len)]  # common prefixes
    while len(groups) < 60:
        for _ in range(rng.choice([0, 1, 2, 3, 4])):
            n = rng.randint(1, max_model_len - 1)
            prompt = shared[: rng.randint(0, n)]
            prompt += [rng.randrange(50) for _ in range(n - len(prompt))]
            max_tokens = rng.randint(1, max_model_len)
            width = rng.randint(1, max_best_of)
            if rng.random() < 0.3:  # beams fork, drop and copy on write every step
                group = make_group(len(groups), prompt, max_tokens, beam_width=max(2, width))
            else:
                group = make_group(len(groups), prompt, max_tokens, width)
            sched.add(group)
            groups.append(group)
        live = [g for g in groups if not g.is_finished]
        if live and rng.random() < 0.05:
            sched.abort_request(rng.choice(live).request_id)
        if sched.num_unfinished:
            run_step(sched)
    run_to_completion(sched, max_steps=5_000)
    assert all(g.is_finished for g in groups)
    assert "more KV blocks than the whole cache" not in caplog.text
    assert_all_free(sched)


@pytest.mark.parametrize("seed", range(30))
def test_random_groups_that_fit_alone_only_sharing_are_never_cut_short(seed, caplog):
    # The cache holds any one group alone, its prompt's full blocks shared, but not all of
    # them, nor one with its sequences unshared: groups are preempted (swapped, or
    # recomputed where the swap space is short), yet every sequence reaches max_tokens.
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    max_model_len = rng.randint(8, 32)
    groups = []
    for i in range(rng.randint(3, 8)):
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, max_model_len - 2))]
        max_tokens = rng.randint(1, max_model_len - len(prompt))
        width = rng.randint(2, 4)
        kind = {"beam_width": width} if rng.random() < 0.4 else {"best_of": width}
        groups.append(make_group(i, prompt, max_tokens, **kind))

    def alone(group: SequenceGroup) -> int:  # the most blocks it ever holds alone
        params, (seq,) = group.sampling_params, group.seqs
        shared = seq.num_prompt_tokens // block_size
        end = -(-(seq.num_prompt_tokens + params.max_tokens) // block_size)
        return shared + params.best_of * (end - shared)

    num_blocks = max(max(map(alone, groups)), -(-max_model_len // block_size))
    chunked = rng.random() < 0.7
    sched = make_scheduler(
        num_blocks=num_blocks + rng.randint(0, 2),
        block_size=block_size,
        max_num_seqs=rng.randint(4, 16),
        max_num_batched_tokens=rng.randint(4, 48) if chunked else max_model_len,
        max_model_len=max_model_len,
        num_cpu_blocks=rng.choice([0, 2, num_blocks]),
        preemption_mode=rng.choice([None, "swap", "recompute"]),
        enable_prefix_caching=rng.random() < 0.7,
        enable_chunked_prefill=chunked,
    )
    finals = {}
    pending = list(groups)
    while pending or sched.has_unfinished_requests():
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                sched.add(pending.pop(0))
        if sched.has_unfinished_requests():
            _, deltas = run_step_with_deltas(sched)
            finals.update((d.request_id, d) for d in deltas if d.finished)
        assert len(finals) <= len(groups)
    assert "more KV blocks than the whole cache" not in caplog.text
    for group in groups:
        max_tokens = group.sampling_params.max_tokens
        if group.sampling_params.use_beam_search:
            lengths = [len(s.token_ids) for s in finals[group.request_id].seqs]
        else:
            lengths = [s.num_output_tokens for s in group.seqs]
        assert lengths == [max_tokens] * group.sampling_params.n, group.request_id
    assert_all_free(sched)
