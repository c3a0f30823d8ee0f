"""The core sends only what changed in each request since its last message, as tokens:
new token ids, their logprobs, finishes. Never text: the front end decodes it."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from tiny_models import random_prompts

from serve import LLM, SamplingParams
from serve.scheduler.output_deltas import RequestDelta, SeqDelta, step_delta
from serve.sequence import FinishReason, Sequence, SequenceGroup


def _group(num_output_tokens: int, **params) -> SequenceGroup:
    seq = Sequence(0, "r", [5, 6, 7], SamplingParams(**params))
    for token in range(num_output_tokens):
        if "logprobs" in params:
            seq.append_token(token, -0.5, {token: -0.5}, token + 1)
        else:
            seq.append_token(token, -0.5, None)
    return SequenceGroup("r", [seq], seq.sampling_params)


def _strings(value) -> list[str]:
    """Every str inside a message (dataclasses, lists, dicts), enums' values excluded."""
    if isinstance(value, str) and not isinstance(value, FinishReason):
        return [value]
    if dataclasses.is_dataclass(value):
        return [s for f in dataclasses.fields(value) for s in _strings(getattr(value, f.name))]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for kv in value.items() for v in kv for s in _strings(v)]
    return []


def test_a_step_costs_its_new_tokens_not_the_whole_output():
    group = _group(1024, logprobs=2)
    first = step_delta(group)
    assert len(first.seqs[0].token_ids) == 1024
    group.seqs[0].append_token(7, -0.1, {7: -0.1})
    delta = step_delta(group)
    assert delta.seqs[0].token_ids == [7] and delta.seqs[0].top_logprobs == [{7: -0.1}]
    assert len(pickle.dumps(delta)) * 20 < len(pickle.dumps(first))
    assert step_delta(group).seqs == []  # nothing new: nothing sent


def test_prompt_logprobs_come_with_the_first_message_only():
    group = _group(1)
    group.prompt_logprobs = [None, {6: -1.0}, {7: -0.5}]
    group.prompt_ranks = [None, 1, 4]
    first = step_delta(group)
    assert (first.prompt_logprobs, first.prompt_ranks) == (
        [None, {6: -1.0}, {7: -0.5}],
        [None, 1, 4],
    )
    group.seqs[0].append_token(3, -0.2, None)
    later = step_delta(group)
    assert later.prompt_logprobs is None and later.prompt_ranks is None


def test_a_finish_without_a_new_token_is_sent_once():
    group = _group(2)
    step_delta(group)
    group.seqs[0].finish_reason = FinishReason.ABORT
    (seq,) = step_delta(group).seqs
    assert seq == SeqDelta(0, [], None, None, FinishReason.ABORT)
    assert step_delta(group).seqs == []


def test_logprobs_are_sent_only_for_requests_that_need_them():
    """Asked for (0 included) or ranked by them (best_of > n): the new tokens' logprobs;
    otherwise None, and the front end reports no cumulative logprob."""
    for params, sent in (
        ({}, None),
        ({"n": 2}, None),
        ({"logprobs": 0}, [-0.5, -0.5]),
        ({"n": 1, "best_of": 2}, [-0.5, -0.5]),
    ):
        (seq,) = step_delta(_group(2, **params)).seqs
        assert seq.logprobs == sent, params
        assert seq.top_logprobs == ([{0: -0.5}, {1: -0.5}] if "logprobs" in params else None)
        assert seq.ranks == ([1, 2] if "logprobs" in params else None)  # asked for alone


def test_engine_steps_send_tokens_and_no_text(tiny_llama):
    """Through a real engine: each step carries at most one new token per sequence, the
    deltas add up to the final outputs, and no message holds a string but ids and errors."""
    llm = LLM(model=str(tiny_llama), kv_cache_memory="8MiB")
    prompts = random_prompts(512, 4, 5, 20, seed=4)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, stop=["a", "e"]),
        SamplingParams(temperature=1.0, seed=2, n=1, best_of=2, max_tokens=6, ignore_eos=True),
    ]
    needs_logprobs = {"r0", "r3"}  # asked for them; ranked by them (best_of > n)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        llm.add_request(f"r{i}", prompt, p)
    sent: dict[tuple[str, int], list[int]] = {}
    sent_logprobs: dict[tuple[str, int], list[float]] = {}
    finals = {}
    while llm.has_unfinished_requests():
        deltas = llm.engine.step()
        for delta in deltas:
            assert isinstance(delta, RequestDelta)
            assert set(_strings(delta)) <= {delta.request_id}
            for seq in delta.seqs:
                assert len(seq.token_ids) <= 1
                if delta.request_id in needs_logprobs:
                    assert seq.logprobs is not None and len(seq.logprobs) == len(seq.token_ids)
                    sent_logprobs.setdefault((delta.request_id, seq.index), []).extend(seq.logprobs)
                else:
                    assert seq.logprobs is None
                sent.setdefault((delta.request_id, seq.index), []).extend(seq.token_ids)
        finals.update({o.request_id: o for o in llm._process(deltas) if o.finished})
    assert set(finals) == {"r0", "r1", "r2", "r3"}
    for request_id, out in finals.items():
        if request_id == "r3":
            continue  # its best sample comes renumbered: checked below
        for c in out.outputs:
            got = sent[(request_id, c.index)]
            assert got[: len(c.token_ids)] == c.token_ids  # after a stop string: dropped
    # The text is the front end's decoding of the ids it was sent.
    r0 = finals["r0"].outputs[0]
    assert len(r0.token_ids) == 12 and r0.text == llm.get_tokenizer().decode(r0.token_ids)
    assert len(finals["r1"].outputs) == 3
    # The front end sums what it was sent; a request that needs no logprobs reports none.
    assert r0.cumulative_logprob == pytest.approx(sum(sent_logprobs[("r0", 0)]))
    assert all(c.cumulative_logprob is None for c in finals["r1"].outputs + finals["r2"].outputs)
    samples = {tuple(sent[("r3", i)]): sum(sent_logprobs[("r3", i)]) for i in range(2)}
    (best,) = finals["r3"].outputs
    assert best.cumulative_logprob == pytest.approx(max(samples.values()))
    assert best.cumulative_logprob == pytest.approx(samples[tuple(best.token_ids)])
