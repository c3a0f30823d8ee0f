"""Prefill-only requests (max_tokens 0: embeddings, prompts scored for their logprobs) in
the scheduler, against the fake worker: never sampled, ended with the step that computes
their last prompt token, their blocks freed in that step, beside generation requests
that run on undisturbed; the prefix cache taken only where the pooling allows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler.harness import (
    add_all,
    assert_all_free,
    check_state,
    fake_pooled,
    make_groups,
    make_scheduler,
    prompt_of,
    run_step,
    run_step_with_deltas,
    run_to_completion,
    worker_of,
)

from serve.pooling_params import PoolingParams
from serve.sampling_params import SamplingParams
from serve.scheduler.output_deltas import RequestDelta
from serve.scheduler.scheduler import Scheduler
from serve.sequence import FinishReason, Sequence, SequenceGroup

LAST = PoolingParams("last", normalize=True)
MEAN = PoolingParams("mean", normalize=True)
CLS = PoolingParams("cls", normalize=False)


def prefill_only_group(
    seq_id: int,
    prompt: list[int],
    pooling: PoolingParams | None = LAST,
    prompt_logprobs: int | None = None,
) -> SequenceGroup:
    params = SamplingParams(max_tokens=0, pooling=pooling, prompt_logprobs=prompt_logprobs)
    seq = Sequence(seq_id, f"r{seq_id}", prompt, params, arrival_time=float(seq_id))
    return SequenceGroup(seq.request_id, [seq], params, arrival_time=float(seq_id))


def final_delta(deltas: list[RequestDelta], request_id: str) -> RequestDelta | None:
    return next((d for d in deltas if d.request_id == request_id and d.finished), None)


@pytest.mark.parametrize("pooling", [LAST, MEAN, CLS, None])
def test_a_chunked_prompt_ends_with_its_last_chunk_and_frees_its_blocks(pooling):
    sched = make_scheduler(max_num_batched_tokens=8, block_size=4)
    (gen,) = add_all(sched, make_groups([6], max_tokens=5))
    emb = prefill_only_group(1, prompt_of(1, 19), pooling)
    sched.add(emb)
    bm = sched.block_manager
    chunks = []
    final = None
    while final is None:
        out, deltas = run_step_with_deltas(sched)
        mine = [s for s in out.scheduled if s.seq_id == 1]
        assert not any(s.is_sampled for s in mine), "a prefill-only sequence was sampled"
        chunks += [(s.start, s.num_new_tokens) for s in mine]
        final = final_delta(deltas, "r1")
        if final is None:
            assert sched.get_group("r1") is not None
    # It ended in the step whose chunk reached its last prompt token, and that step's
    # update freed its blocks: nothing of it is left but the prefix cache's full blocks.
    start, n = chunks[-1]
    assert start + n == 19 and sum(n for _, n in chunks) == 19 and len(chunks) >= 3
    assert sched.get_group("r1") is None and not bm.has_table(1)
    assert emb.is_finished and emb.seqs[0].output_token_ids == []
    (seq_delta,) = final.seqs
    assert seq_delta.token_ids == []
    if pooling is None:  # scored, as echo with max_tokens 0 asks: OpenAI's "length"
        assert final.pooled is None and seq_delta.finish_reason is FinishReason.LENGTH
    else:
        assert final.pooled == fake_pooled(prompt_of(1, 19))
        assert seq_delta.finish_reason is FinishReason.STOP
    assert final.times is not None and final.times.decode_s == 0.0
    # The generation request beside it runs on to its own end.
    run_to_completion(sched)
    assert gen.seqs[0].num_output_tokens == 5
    assert_all_free(sched)


def test_a_prompt_as_long_as_the_context_window_fits_when_nothing_is_sampled():
    sched = make_scheduler(num_blocks=8, block_size=4, max_model_len=32)
    full = prefill_only_group(0, prompt_of(0, 32))
    sched.add(full)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(prefill_only_group(1, prompt_of(1, 33)))
    (too_long_to_generate,) = make_groups([32], first_id=2)
    with pytest.raises(ValueError, match="at least one must be left for the output"):
        sched.add(too_long_to_generate)
    run_to_completion(sched)
    assert full.is_finished and full.seqs[0].num_computed_tokens == 32
    assert_all_free(sched)


@pytest.mark.parametrize(
    ("pooling", "prompt_logprobs", "cached_tokens"),
    [
        (LAST, None, 12),  # the last token is always computed: its hidden state is exact
        (MEAN, None, 0),  # every hidden state is needed: a hit would skip some
        (CLS, None, 0),
        (None, 1, 0),  # prompt logprobs need every position's logits
    ],
)
def test_prefix_cache_hits_only_where_pooling_reads_the_last_token(
    pooling, prompt_logprobs, cached_tokens
):
    sched = make_scheduler(block_size=4, max_num_batched_tokens=64)
    prompt = prompt_of(0, 16)
    add_all(sched, [make_groups([16])[0]])  # a generation request warms the prefix cache
    run_to_completion(sched)
    group = prefill_only_group(1, list(prompt), pooling, prompt_logprobs)
    sched.add(group)
    out, deltas = run_step_with_deltas(sched)
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens) == (cached_tokens, 16 - cached_tokens)
    final = final_delta(deltas, "r1")
    assert final is not None
    if pooling is not None:
        assert final.pooled == fake_pooled(prompt)
    assert_all_free(sched)


def test_a_last_chunk_in_flight_holds_up_no_prefill_behind_it():
    """Scheduling ahead (async scheduling): the next step is scheduled while the last
    chunk of a prefill-only request runs. It has nothing left to compute, and the running
    prefill behind it must still get the step's budget."""
    sched = make_scheduler(max_num_batched_tokens=8, block_size=4)
    emb = prefill_only_group(0, prompt_of(0, 12), MEAN)
    (gen,) = make_groups([20], max_tokens=2, first_id=1)
    add_all(sched, [emb, gen])
    run_step(sched)  # emb's first 8 tokens
    worker = worker_of(sched)
    out = sched.schedule()  # emb's last 4, gen's first 4
    assert [(s.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 4), (1, 4)]
    result = worker.execute(out)
    ahead = sched.schedule()  # before `out`'s output is in
    assert [(s.seq_id, s.num_new_tokens) for s in ahead.scheduled] == [(1, 8)]
    deltas = sched.update_from_output(out, result)
    final = final_delta(deltas, "r0")
    assert final is not None and final.pooled == fake_pooled(prompt_of(0, 12))
    assert not sched.block_manager.has_table(0)  # freed with the update of its last chunk
    sched.update_from_output(ahead, worker.execute(ahead))
    check_state(sched)
    run_to_completion(sched)
    assert gen.seqs[0].num_output_tokens == 2
    assert_all_free(sched)


def _step_collecting(sched: Scheduler, pooled: dict[str, list[float]]) -> None:
    """One step; the pooled vectors its deltas carry, by request."""
    _, deltas = run_step_with_deltas(sched)
    for delta in deltas:
        if delta.pooled is not None:
            assert delta.request_id not in pooled, "pooled twice"
            pooled[delta.request_id] = delta.pooled


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(2, 24),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 24),
    chunked=st.booleans(),
    data=st.data(),
)
def test_random_mix_with_generation_preemption_and_aborts(
    block_size, num_blocks, max_num_seqs, max_num_batched_tokens, chunked, data
):
    """Every step's invariants (harness.py) hold with prefill-only requests of every kind
    mixed in; each one not aborted is pooled once, with its own prompt's vector, and
    samples nothing; every generation request gets its tokens; all blocks come back."""
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
    aborted: set[str] = set()
    pooled: dict[str, list[float]] = {}
    for _ in range(data.draw(st.integers(0, 30), label="num_steps")):
        for _ in range(data.draw(st.integers(0, 2))):
            seq_id = len(groups)
            kind = data.draw(st.sampled_from(["generate", "last", "mean", "cls", "scored"]))
            if kind == "generate":
                prompt_len = data.draw(st.integers(1, max_model_len - 1))
                max_tokens = data.draw(st.integers(1, 8))
                (group,) = make_groups([prompt_len], max_tokens=max_tokens, first_id=seq_id)
            else:
                prompt = prompt_of(seq_id, data.draw(st.integers(1, max_model_len)))
                pooling = {"last": LAST, "mean": MEAN, "cls": CLS}.get(kind)
                group = prefill_only_group(seq_id, prompt, pooling, 0 if pooling is None else None)
            sched.add(group)
            groups.append(group)
        live = [g for g in groups if not g.is_finished]
        if live and data.draw(st.booleans()):
            victim = data.draw(st.sampled_from(live))
            sched.abort_request(victim.request_id)
            aborted.add(victim.request_id)
            check_state(sched)
        if sched.num_unfinished:
            _step_collecting(sched, pooled)
    for _ in range(5_000):
        if not sched.has_unfinished_requests():
            break
        _step_collecting(sched, pooled)
    assert not sched.has_unfinished_requests(), "the scheduler stopped making progress"
    for group in groups:
        assert group.is_finished
        seq = group.seqs[0]
        params = group.sampling_params
        if group.request_id in aborted:
            continue
        if params.is_prefill_only:
            assert seq.num_output_tokens == 0
            if params.pooling is not None:
                assert pooled[group.request_id] == fake_pooled(seq.prompt_token_ids)
            else:  # scored: ended as OpenAI's echo with max_tokens 0 ends
                assert seq.finish_reason is FinishReason.LENGTH
        else:
            expected = min(params.max_tokens, max_model_len - seq.num_prompt_tokens)
            assert seq.num_output_tokens == expected
    assert_all_free(sched)
