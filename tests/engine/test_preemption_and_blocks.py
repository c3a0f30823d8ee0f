"""Preemption by recompute keeps outputs exact; every request gives its blocks back."""

from __future__ import annotations

import pytest
from tiny_models import random_prompts

from serve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(512, 8, 10, 40, seed=21)


def _generate(llm: LLM, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_small_cache_preempts_and_matches_large_cache(tiny_llama, prompts):
    large = LLM(model=str(tiny_llama), block_size=4, kv_cache_memory="8MiB")
    expected = _generate(large, prompts)
    # 24 blocks x 4 tokens = 96 tokens, while the 8 requests need up to 8 x 70.
    small = LLM(model=str(tiny_llama), block_size=4, num_gpu_blocks_override=24)
    assert small.engine.max_model_len == 96
    assert _generate(small, prompts) == expected
    assert small.engine.scheduler.num_preemptions > 0
    manager = small.engine.block_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks


def test_finished_and_aborted_requests_free_all_blocks(tiny_llama, prompts):
    llm = LLM(model=str(tiny_llama), block_size=4, kv_cache_memory="8MiB")
    manager = llm.engine.block_manager
    for i, prompt in enumerate(prompts):
        llm.add_request(f"r{i}", prompt, GREEDY)
    for _ in range(3):
        llm.step()
    manager.check_invariants()
    assert manager.num_free_blocks < manager.num_blocks
    aborted = llm.abort_request("r1")
    assert aborted is not None and aborted.finished
    assert aborted.outputs[0].finish_reason == "abort"
    llm.abort_request("r6")  # still waiting or just admitted
    assert llm.abort_request("no-such-request") is None
    manager.check_invariants()
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out
        manager.check_invariants()
    assert set(finished) == {f"r{i}" for i in range(len(prompts))} - {"r1", "r6"}
    assert all(o.outputs[0].finish_reason == "length" for o in finished.values())
    assert manager.num_free_blocks == manager.num_blocks


def test_cache_too_small_for_max_model_len_says_what_to_change(tiny_llama):
    with pytest.raises(ValueError, match=r"holds 64 tokens.*--max-model-len"):
        LLM(model=str(tiny_llama), block_size=4, num_gpu_blocks_override=16, max_model_len=128)


def test_max_model_len_ends_generation_with_length(tiny_llama):
    llm = LLM(model=str(tiny_llama), max_model_len=32, kv_cache_memory="8MiB")
    prompt = random_prompts(512, 1, 20, 20, seed=2)[0]
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12  # 20 prompt + 12 output = 32
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param(
            {"preemption_mode": "recompute", "enable_prefix_caching": False}, id="recompute"
        ),
        pytest.param({"preemption_mode": "swap", "swap_space": 0.00001}, id="swap-space-full"),
    ],
)
def test_a_group_that_fits_alone_is_not_cut_short_by_a_neighbour(tiny_llama, engine_kwargs):
    """Recomputed, a group of n sequences comes back as n prompts that no longer share
    their blocks; on a small cache it then never fits again and was ended short, as if
    by max_tokens. The neighbour of one sequence is preempted instead."""
    llm = LLM(model=str(tiny_llama), num_gpu_blocks_override=30, block_size=4, **engine_kwargs)
    neighbour, target = random_prompts(512, 2, 20, 44, seed=3)
    neighbour, target = neighbour[:20], (target * 3)[:44]
    sampled = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=24, ignore_eos=True)
    (alone,) = llm.generate([target], sampled, use_tqdm=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first, beside = llm.generate([neighbour, target], [greedy, sampled], use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in beside.outputs] == [c.token_ids for c in alone.outputs]
    assert [c.finish_reason for c in beside.outputs] == ["length", "length"]
    assert len(first.outputs[0].token_ids) == 40
