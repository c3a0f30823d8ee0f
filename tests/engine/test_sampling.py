"""Sampling controls: seeds are per request, temperature 0 and top-k 1 are greedy."""

from __future__ import annotations

import pytest
from tiny_models import random_prompts

from serve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(512, 6, 4, 30, seed=9)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_same_seed_same_tokens_whatever_the_batch(llm, prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _tokens(llm.generate(prompts[0], seeded, use_tqdm=False))[0]
    others = [
        SamplingParams(temperature=0.8, max_tokens=k, ignore_eos=True) for k in (3, 25, 7, 12, 30)
    ]
    together = _tokens(llm.generate(prompts, [seeded, *others], use_tqdm=False))[0]
    reversed_batch = llm.generate([*prompts[1:], prompts[0]], [*others, seeded], use_tqdm=False)
    assert alone == together == _tokens(reversed_batch)[-1]
    different_seed = SamplingParams(
        temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True
    )
    assert _tokens(llm.generate(prompts[0], different_seed, use_tqdm=False))[0] != alone


def test_unseeded_sampling_varies(llm, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    runs = {tuple(_tokens(llm.generate(prompts[0], params, use_tqdm=False))[0]) for _ in range(3)}
    assert len(runs) > 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=1.3, top_k=1, max_tokens=20, seed=5),
        SamplingParams(temperature=0.7, min_p=1.0, max_tokens=20),
        SamplingParams(temperature=0.7, top_p=1e-6, max_tokens=20),
    ],
    ids=["temperature-0", "top-k-1", "min-p-1", "tiny-top-p"],
)
def test_degenerate_filters_equal_greedy(llm, prompts, params):
    greedy = _tokens(
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    )
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == greedy


def test_top_k_restricts_choices(llm, prompts):
    """Every sampled token is among the k most likely under the same model's logprobs."""
    params = SamplingParams(temperature=5.0, top_k=3, logprobs=3, max_tokens=15, ignore_eos=True)
    for out in llm.generate(prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        for token, top in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token in top and len(top) == 3


def test_logprobs_are_log_probabilities(llm, prompts):
    params = SamplingParams(temperature=0.0, logprobs=2, max_tokens=10)
    out = llm.generate(prompts[0], params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, top in zip(out.token_ids, out.logprobs, strict=True):
        assert all(lp <= 0 for lp in top.values())
        assert max(top, key=top.get) == token  # greedy takes the most likely token
    assert out.cumulative_logprob == pytest.approx(
        sum(t[tok] for tok, t in zip(out.token_ids, out.logprobs))
    )
