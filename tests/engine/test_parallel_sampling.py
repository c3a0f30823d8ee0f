"""Parallel sampling (`n`, `best_of`): one prefill, forked samples sharing the prompt's
blocks, copy-on-write for the partly filled last one.

The seed derivation: sample i of a request with `seed=s` draws from its own stream seeded
`s + i`, so it equals a lone request with `seed=s + i`, whatever else runs beside it.
"""

from __future__ import annotations

import pytest
from tiny_models import hf_greedy, random_prompts

from serve import LLM, SamplingParams

SEED = 7
MAX_TOKENS = 20
BLOCK_SIZE = 4


def _llm(model_dir, **kwargs) -> LLM:
    kwargs = {"block_size": BLOCK_SIZE, "kv_cache_memory": "4MiB", "swap_space": 0.001, **kwargs}
    return LLM(model=str(model_dir), **kwargs)


def _sampling(**kwargs) -> SamplingParams:
    kwargs = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **kwargs}
    return SamplingParams(**kwargs)


def _assert_idle(llm: LLM) -> None:
    llm.engine.block_manager.check_invariants()
    assert llm.stats().num_blocks_used == 0


@pytest.fixture(scope="module")
def prompt():
    return random_prompts(512, 1, 30, 30, seed=5)[0]  # 7 full blocks + 2 tokens


@pytest.fixture(scope="module")
def separate_samples(tiny_llama, prompt):
    """The 4 samples as 4 lone requests with the derived seeds, one generate call each."""
    llm = _llm(tiny_llama)
    outs = [
        llm.generate({"prompt_token_ids": prompt}, _sampling(seed=SEED + i), use_tqdm=False)[0]
        for i in range(4)
    ]
    return [o.outputs[0] for o in outs]


def test_n4_equals_separate_requests_with_derived_seeds(tiny_llama, prompt, separate_samples):
    llm = _llm(tiny_llama)
    out = llm.generate({"prompt_token_ids": prompt}, _sampling(n=4, seed=SEED), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in separate_samples]
    assert [c.text for c in out.outputs] == [s.text for s in separate_samples]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4  # the seeds differ
    # Nothing ranks n samples, and none asked for logprobs: no cumulative logprob (vLLM's).
    assert all(c.cumulative_logprob is None for c in out.outputs + separate_samples)

    # The 4 lone requests submitted together, beside the n=4 request itself.
    prompts = [{"prompt_token_ids": prompt}] * 5
    params = [_sampling(seed=SEED + i) for i in range(4)] + [_sampling(n=4, seed=SEED)]
    *together, n4 = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == [s.token_ids for s in separate_samples]
    assert [c.token_ids for c in n4.outputs] == [s.token_ids for s in separate_samples]
    _assert_idle(llm)


def test_n4_uses_fewer_blocks_than_separate_requests(tiny_llama, prompt, separate_samples):
    # Without prefix caching, so that the separate requests share nothing.
    llm = _llm(tiny_llama, enable_prefix_caching=False)
    llm.reset_peak()
    out = llm.generate({"prompt_token_ids": prompt}, _sampling(n=4, seed=SEED), use_tqdm=False)[0]
    peak_n4 = llm.stats().peak_num_blocks_used
    _assert_idle(llm)

    llm.reset_peak()
    params = [_sampling(seed=SEED + i) for i in range(4)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 4, params, use_tqdm=False)
    peak_separate = llm.stats().peak_num_blocks_used
    _assert_idle(llm)

    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in outs]
    # Each sequence holds 30 + 20 - 1 computed tokens: 13 blocks. The n=4 request shares
    # the prompt's 7 full blocks and owns the rest (the partial 8th block copied on write).
    assert peak_separate == 4 * 13
    assert peak_n4 == 7 + 4 * (13 - 7)
    assert peak_n4 < peak_separate


def test_best_of_returns_the_n_best_samples_sorted(tiny_llama, prompt):
    llm = _llm(tiny_llama)
    # logprobs=0: the sampled tokens' logprobs, which n alone does not compute.
    all4 = llm.generate(
        {"prompt_token_ids": prompt}, _sampling(n=4, seed=SEED, logprobs=0), use_tqdm=False
    )
    best = llm.generate(
        {"prompt_token_ids": prompt}, _sampling(n=2, best_of=4, seed=SEED), use_tqdm=False
    )[0]
    ranked = sorted(all4[0].outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1]
    scores = [c.cumulative_logprob for c in best.outputs]
    assert scores == sorted(scores, reverse=True)
    assert scores == pytest.approx([c.cumulative_logprob for c in ranked[:2]], abs=1e-4)
    # The ranking is not just the order of the seeds.
    assert [c.token_ids for c in best.outputs] != [c.token_ids for c in all4[0].outputs[:2]]
    _assert_idle(llm)


def _record_schedules(llm: LLM, monkeypatch) -> list:
    scheduler = llm.engine.scheduler
    original = scheduler.schedule
    seen = []

    def recording_schedule():
        out = original()
        seen.append(out)
        return out

    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    return seen


def test_fork_shares_blocks_and_copies_the_partial_last_one(
    tiny_llama, prompt, separate_samples, monkeypatch
):
    llm = _llm(tiny_llama, async_scheduling=False)  # each step() runs one whole step
    manager = llm.engine.block_manager
    schedules = _record_schedules(llm, monkeypatch)
    llm.add_request("n4", prompt, _sampling(n=4, seed=SEED))
    llm.step()  # the prompt's prefill, then the fork into 4 samples
    tables = [list(t) for t in manager.block_tables.values()]
    assert len(tables) == 4 and all(t == tables[0] for t in tables)
    shared = tables[0]
    assert len(shared) == 8
    assert all(manager.block_pool.ref_count(b) == 4 for b in shared)
    manager.check_invariants()

    llm.step()  # each sample writes its first token into the shared partial block
    copies = schedules[-1].blocks_to_copy
    assert len(copies) == 3  # the 4th writer finds itself the only holder left
    assert {src for src, _ in copies} == {shared[-1]}  # never a full block
    assert len({dst for _, dst in copies}) == 3
    tables = list(manager.block_tables.values())
    assert all(t[:7] == shared[:7] for t in tables)
    assert len({t[7] for t in tables}) == 4
    assert all(manager.block_pool.ref_count(b) == 4 for b in shared[:7])
    manager.check_invariants()

    finished = None
    while llm.has_unfinished_requests():
        for out in llm.step():
            finished = out if out.finished else finished
        manager.check_invariants()
    assert [c.token_ids for c in finished.outputs] == [s.token_ids for s in separate_samples]
    assert sum(len(s.blocks_to_copy) for s in schedules) == 3
    _assert_idle(llm)


def test_block_aligned_prompt_forks_without_copies(tiny_llama, monkeypatch):
    prompt = random_prompts(512, 1, 32, 32, seed=32)[0]  # exactly 8 full blocks
    llm = _llm(tiny_llama)
    schedules = _record_schedules(llm, monkeypatch)
    out = llm.generate({"prompt_token_ids": prompt}, _sampling(n=4, seed=SEED), use_tqdm=False)
    assert not any(s.blocks_to_copy for s in schedules)
    alone = _llm(tiny_llama).generate(
        [{"prompt_token_ids": prompt}] * 4,
        [_sampling(seed=SEED + i) for i in range(4)],
        use_tqdm=False,
    )
    assert [c.token_ids for c in out[0].outputs] == [o.outputs[0].token_ids for o in alone]
    _assert_idle(llm)


def test_greedy_n3_gives_three_copies_of_hf_greedy(tiny_llama):
    prompts = random_prompts(512, 2, 5, 30, seed=8)
    llm = _llm(tiny_llama)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(tiny_llama, prompt, MAX_TOKENS, ignore_eos=True)
        assert [c.token_ids for c in out.outputs] == [expected] * 3
        assert all(c.finish_reason == "length" for c in out.outputs)
    _assert_idle(llm)
