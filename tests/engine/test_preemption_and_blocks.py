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
    """Recomputed, a group of n sequences comes back with its sequences sharing their
    prompt's blocks again: it fits as it did (unshared, it would never fit again on a
    small cache, and would be ended short, as if by max_tokens)."""
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


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"preemption_mode": "recompute"}, id="recompute"),
        pytest.param({"swap_space": 0.00001}, id="swap-space-full"),
    ],
)
def test_beam_searches_that_each_fit_alone_all_finish_side_by_side(tiny_llama, engine_kwargs):
    """Two beam searches of width 4, each of which fits the 20-block cache alone (its
    beams share their prompt and much of their output: 19 blocks at most), not both. The
    one preempted is recomputed, its beams sharing again what they shared; it was ended
    after 5 of its 40 tokens ("length"), its beams unshared outgrowing the cache."""
    llm = LLM(
        model=str(tiny_llama),
        block_size=4,
        num_gpu_blocks_override=20,
        max_num_batched_tokens=16,
        **engine_kwargs,
    )
    prompts = [{"prompt_token_ids": p} for p in random_prompts(512, 2, 20, 20, seed=5)]
    beams = SamplingParams(use_beam_search=True, best_of=4, max_tokens=40, temperature=0.0)
    crowd = llm.generate(prompts, beams, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    alone = [llm.generate([p], beams, use_tqdm=False)[0] for p in prompts]
    assert [len(o.outputs[0].token_ids) for o in crowd] == [40, 40]
    assert [o.outputs[0].token_ids for o in crowd] == [o.outputs[0].token_ids for o in alone]
