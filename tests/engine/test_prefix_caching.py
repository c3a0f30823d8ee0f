"""Automatic prefix caching: hits skip recomputation, never change the output.

A full block of computed tokens is cached under a hash of its tokens chained with its
prefix's; a new request takes every cached full block of its longest matching prefix
(never its last prompt token, whose logits it needs). So a prompt of L tokens after a
cached one with the same first tokens hits `min(shared, L - 1) // block_size` blocks.
"""

from __future__ import annotations

import pytest
from tiny_models import hf_greedy, random_prompts

from serve import LLM, SamplingParams

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _llm(model_dir, **kwargs) -> LLM:
    # A small swap space keeps check_invariants (which walks the CPU pool too) cheap.
    kwargs = {"kv_cache_memory": "4MiB", "swap_space": 0.001, **kwargs}
    return LLM(model=str(model_dir), **kwargs)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_matches_hf(model_dir, prompts, got) -> None:
    for i, (prompt, tokens) in enumerate(zip(prompts, got, strict=True)):
        expected = hf_greedy(model_dir, prompt, MAX_TOKENS, ignore_eos=True)
        assert tokens == expected, f"prompt {i} diverged from HF"


def _assert_idle(llm: LLM) -> None:
    """No request alive: every block is free (cached ones included), ref counts agree."""
    llm.engine.block_manager.check_invariants()
    stats = llm.stats()
    assert stats.num_blocks_used == 0
    assert llm.engine.block_manager.num_free_blocks == stats.num_blocks_total


@pytest.mark.parametrize("prompt_len", [30, 32], ids=["mid-block", "block-aligned"])
def test_same_prompt_twice_hits_and_matches_hf(tiny_llama, prompt_len):
    prompt = random_prompts(512, 1, prompt_len, prompt_len, seed=prompt_len)[0]
    llm = _llm(tiny_llama, block_size=4)
    first = _greedy(llm, [prompt])
    stats = llm.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (prompt_len, 0)

    second = _greedy(llm, [prompt])
    stats = llm.stats()
    expected_hits = (prompt_len - 1) // 4 * 4  # the last prompt token is always recomputed
    assert stats.prefix_cache_hits == expected_hits
    assert stats.prefix_cache_queries == 2 * prompt_len
    assert stats.prefix_cache_hit_rate == pytest.approx(expected_hits / (2 * prompt_len))
    assert first == second
    _assert_matches_hf(tiny_llama, [prompt], second)
    assert second == _greedy(_llm(tiny_llama, block_size=4, enable_prefix_caching=False), [prompt])
    _assert_idle(llm)


@pytest.mark.parametrize("block_size", [4, 16])
def test_shared_system_prompt_with_different_user_turns(tiny_llama, block_size):
    """40 system tokens: block-aligned for block size 4, mid-block for 16."""
    system = random_prompts(512, 1, 40, 40, seed=40)[0]
    prompts = [system + user for user in random_prompts(512, 4, 3, 12, seed=block_size)]
    llm = _llm(tiny_llama, block_size=block_size)
    got = _greedy(llm, prompts[:1])  # warms the cache with the system prompt
    hits_before = llm.stats().prefix_cache_hits
    got += _greedy(llm, prompts[1:])
    assert llm.stats().prefix_cache_hits - hits_before == 3 * (40 // block_size * block_size)

    _assert_matches_hf(tiny_llama, prompts, got)
    no_cache = _llm(tiny_llama, block_size=block_size, enable_prefix_caching=False)
    assert _greedy(no_cache, prompts) == got
    _assert_idle(llm)


@pytest.mark.parametrize("block_size", [4, 8])
def test_shared_prefix_ending_mid_block(tiny_llama, block_size):
    """An 18-token prefix fills 18 // block_size blocks; the block it ends in differs per
    request and must be computed afresh, not taken from the cache."""
    prefix = random_prompts(512, 1, 18, 18, seed=18)[0]
    suffixes = random_prompts(512, 3, 5, 9, seed=block_size)
    # The last prompt is the prefix alone: a strict prefix of a cached sequence, ending
    # inside one of its cached blocks.
    prompts = [prefix + s for s in suffixes] + [prefix]
    llm = _llm(tiny_llama, block_size=block_size)
    got = _greedy(llm, prompts[:1])
    hits_before = llm.stats().prefix_cache_hits
    got += _greedy(llm, prompts[1:])
    full_prefix_blocks = 18 // block_size * block_size
    assert llm.stats().prefix_cache_hits - hits_before == 3 * full_prefix_blocks

    _assert_matches_hf(tiny_llama, prompts, got)
    no_cache = _llm(tiny_llama, block_size=block_size, enable_prefix_caching=False)
    assert _greedy(no_cache, prompts) == got
    _assert_idle(llm)


def test_second_turn_reuses_the_first_turns_output_blocks(tiny_llama):
    """Blocks filled by decoding are cached too: a follow-up whose prompt is the first
    prompt + its answer + a new user turn hits through the answer."""
    first_prompt, user = random_prompts(512, 2, 10, 21, seed=3)
    llm = _llm(tiny_llama, block_size=4)
    (answer,) = _greedy(llm, [first_prompt])
    computed = len(first_prompt) + len(answer) - 1  # the last sampled token has no K/V yet
    assert llm.stats().num_blocks_cached == computed // 4

    second_prompt = first_prompt + answer + user
    hits_before = llm.stats().prefix_cache_hits
    got = _greedy(llm, [second_prompt])
    assert llm.stats().prefix_cache_hits - hits_before == computed // 4 * 4
    assert computed // 4 * 4 > len(first_prompt)  # reached into the answer's blocks
    _assert_matches_hf(tiny_llama, [second_prompt], got)
    _assert_idle(llm)


def test_cached_blocks_outlive_their_requests(tiny_llama):
    prompts = random_prompts(512, 3, 20, 30, seed=9)
    llm = _llm(tiny_llama, block_size=4)
    got = _greedy(llm, prompts)
    stats = llm.stats()
    assert stats.num_blocks_used == 0
    # Every full block each request computed (prompt + all outputs but the last).
    assert stats.num_blocks_cached == sum((len(p) + MAX_TOKENS - 1) // 4 for p in prompts)
    _assert_idle(llm)
    assert _greedy(llm, prompts) == got  # all three hit now
    assert llm.stats().prefix_cache_hits == sum((len(p) - 1) // 4 * 4 for p in prompts)


def test_eviction_under_pressure_keeps_outputs_exact(tiny_llama):
    """24 blocks of 4 tokens: later requests evict a finished request's cached blocks,
    least recently used (its tail) first, so its rerun hits only part of its prompt."""
    a, b, c = random_prompts(512, 3, 14, 30, seed=12)
    llm = _llm(tiny_llama, block_size=4, num_gpu_blocks_override=24)
    expected = {
        i: hf_greedy(tiny_llama, p, MAX_TOKENS, ignore_eos=True) for i, p in enumerate((a, b, c))
    }
    assert _greedy(llm, [a]) == [expected[0]]
    cached_after_a = llm.stats().num_blocks_cached
    assert _greedy(llm, [b]) == [expected[1]]
    assert _greedy(llm, [c]) == [expected[2]]
    stats = llm.stats()
    # a's, b's and c's blocks do not all fit: something was evicted.
    assert stats.num_blocks_cached < cached_after_a + sum(
        (len(p) + MAX_TOKENS - 1) // 4 for p in (b, c)
    )
    hits_before = stats.prefix_cache_hits
    assert _greedy(llm, [a]) == [expected[0]]
    hits = llm.stats().prefix_cache_hits - hits_before
    assert hits < (len(a) - 1) // 4 * 4, "a's blocks should have been (partly) evicted"
    _assert_idle(llm)


def test_shared_prefix_under_pressure_matches_hf(tiny_llama):
    """Many requests sharing a system prompt in a cache that holds about two of them:
    hits, evictions and recompute preemptions interleave; outputs stay exact."""
    system = random_prompts(512, 1, 22, 22, seed=22)[0]
    prompts = [system + user for user in random_prompts(512, 6, 2, 8, seed=6)]
    llm = _llm(tiny_llama, block_size=4, num_gpu_blocks_override=24)
    got = _greedy(llm, prompts)
    stats = llm.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.num_preemptions > 0
    _assert_matches_hf(tiny_llama, prompts, got)
    _assert_idle(llm)


def test_preempted_requests_are_looked_up_once(tiny_llama):
    """vLLM's prefix_cache_queries: each request's prompt tokens, once. A request
    recomputed after a preemption is not looked up again: its output so far is no prompt,
    and the blocks it computed itself are no hits."""
    prompts = random_prompts(512, 5, 21, 21, seed=21)
    llm = _llm(tiny_llama, block_size=4, num_gpu_blocks_override=20, max_num_seqs=3)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert stats.prefix_cache_hits == 0  # five different prompts: nothing to share
    _assert_idle(llm)


def test_disabled_prefix_caching_never_hits(tiny_llama):
    prompt = random_prompts(512, 1, 30, 30, seed=30)[0]
    llm = _llm(tiny_llama, block_size=4, enable_prefix_caching=False)
    first = _greedy(llm, [prompt])
    assert _greedy(llm, [prompt]) == first
    stats = llm.stats()
    assert stats.prefix_cache_hits == 0
    assert stats.prefix_cache_hit_rate == 0.0
    assert stats.num_blocks_cached == 0
    _assert_idle(llm)


def test_reset_prefix_cache_makes_the_next_prompt_compute_afresh(tiny_llama):
    """vLLM's `LLM.reset_prefix_cache()`, as benchmarks call it between cold runs."""
    prompt = random_prompts(512, 1, 30, 30, seed=31)[0]
    llm = _llm(tiny_llama, block_size=4)
    first = _greedy(llm, [prompt])
    assert llm.stats().num_blocks_cached > 0
    hits = llm.stats().prefix_cache_hits
    assert llm.reset_prefix_cache(reset_running_requests=False, reset_connector=False)
    assert llm.stats().num_blocks_cached == 0
    assert _greedy(llm, [prompt]) == first
    assert llm.stats().prefix_cache_hits == hits  # nothing was left to hit
    assert _greedy(llm, [prompt]) == first
    assert llm.stats().prefix_cache_hits > hits  # cached again by the run before
    _assert_idle(llm)
