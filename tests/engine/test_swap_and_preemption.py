"""Preemption under a tiny KV cache, by recompute and by swapping to the CPU, leaves every
output exact: greedy equals HF, seeded samples and beams equal the same requests run in a
cache big enough that nothing is preempted.

The default rule (vLLM's): a group with several live sequences is swapped out, a single
sequence is recomputed; `preemption_mode` forces one; a swap space too small for the
victim falls back to recompute.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from tiny_models import hf_beam_search, hf_greedy, random_prompts

from serve import LLM, SamplingParams

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _llm(model_dir, **kwargs) -> LLM:
    # 1 MiB of swap space is 512 blocks of this model: plenty, and cheap to check.
    kwargs = {"block_size": BLOCK_SIZE, "swap_space": 0.001, **kwargs}
    if "num_gpu_blocks_override" not in kwargs:
        kwargs["kv_cache_memory"] = "4MiB"
    return LLM(model=str(model_dir), **kwargs)


def _sampled(n: int, seed: int) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)


@dataclass
class Victim:
    """A group preempted in some step, and where it went."""

    num_live_seqs: int
    is_swapped: bool  # in the scheduler's swapped queue
    is_waiting: bool  # back in the waiting queue, to be recomputed


@dataclass
class StepRecord:
    """What one `schedule()` decided, and the queues right after it."""

    num_swap_outs: int
    num_swap_ins: int
    victims: list[Victim]
    num_swapped: int
    num_cpu_blocks_used: int


def _run(llm: LLM, prompts, params) -> tuple[list[list[list[int]]], list[StepRecord]]:
    """Step the engine by hand over all requests at once, checking the block manager after
    every step. Returns each request's output token ids and a record of every step."""
    engine, scheduler = llm.engine, llm.engine.scheduler
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        llm.add_request(f"r{i}", prompt, p)
    steps: list[StepRecord] = []
    finished = {}
    original = scheduler.schedule

    def recording_schedule():
        out = original()
        preempted = [scheduler.get_group(request_id) for request_id in out.preempted_request_ids]
        victims = [
            Victim(len(g.live_seqs), g in scheduler.swapped, g in scheduler.waiting)
            for g in preempted
        ]
        for v in victims:  # the status agrees with the queue
            assert not (v.is_swapped and v.is_waiting)
        steps.append(
            StepRecord(
                len(out.blocks_to_swap_out),
                len(out.blocks_to_swap_in),
                victims,
                len(scheduler.swapped),
                llm.stats().num_cpu_blocks_used,
            )
        )
        return out

    scheduler.schedule = recording_schedule
    try:
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.finished:
                    finished[out.request_id] = [c.token_ids for c in out.outputs]
            engine.block_manager.check_invariants()
    finally:
        del scheduler.schedule
    return [finished[f"r{i}"] for i in range(len(prompts))], steps


def _assert_idle(llm: LLM) -> None:
    """Every block free or cached-evictable, on the device and in the swap space."""
    manager = llm.engine.block_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.cpu_pool.num_used_blocks == 0
    stats = llm.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)


def _num_swaps(steps: list[StepRecord]) -> tuple[int, int]:
    """Blocks swapped out and in over the whole run."""
    return sum(s.num_swap_outs for s in steps), sum(s.num_swap_ins for s in steps)


def _victims(steps: list[StepRecord]) -> list[Victim]:
    return [v for s in steps for v in s.victims]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(512, 8, 10, 30, seed=21)


@pytest.fixture(scope="module")
def hf_outputs(tiny_llama, prompts):
    return [[hf_greedy(tiny_llama, p, 24, ignore_eos=True)] for p in prompts]


def test_recompute_preemption_matches_hf(tiny_llama, prompts, hf_outputs):
    # 24 blocks x 4 tokens: about two of the 8 requests (up to 54 tokens each) fit.
    llm = _llm(tiny_llama, num_gpu_blocks_override=24, preemption_mode="recompute")
    got, steps = _run(llm, prompts, GREEDY)
    assert got == hf_outputs
    assert llm.stats().num_preemptions > 0
    assert _num_swaps(steps) == (0, 0)
    _assert_idle(llm)


def test_forced_swap_preemption_matches_hf(tiny_llama, prompts, hf_outputs):
    llm = _llm(tiny_llama, num_gpu_blocks_override=24, preemption_mode="swap")
    got, steps = _run(llm, prompts, GREEDY)
    assert got == hf_outputs
    stats = llm.stats()
    assert stats.num_preemptions > 0
    num_out, num_in = _num_swaps(steps)
    assert num_out > 0 and num_in > 0
    assert max(s.num_swapped for s in steps) > 0
    assert max(s.num_cpu_blocks_used for s in steps) > 0
    assert all(v.is_swapped for v in _victims(steps))
    _assert_idle(llm)


def test_forced_swap_preemption_of_a_latent_cache_matches_hf(tiny_model_factory, prompts):
    """DeepSeek's layers keep K and V in one tensor (half the blocks' bytes): each block
    is swapped out and in once, and the outputs stay transformers'."""
    model_dir = tiny_model_factory("deepseek-v2")
    llm = _llm(model_dir, num_gpu_blocks_override=24, preemption_mode="swap")
    got, steps = _run(llm, prompts, GREEDY)
    assert got == [[hf_greedy(model_dir, p, 24, ignore_eos=True)] for p in prompts]
    num_out, num_in = _num_swaps(steps)
    assert num_out > 0 and num_in > 0
    _assert_idle(llm)


@pytest.fixture(scope="module")
def group_prompts():
    return random_prompts(512, 4, 8, 14, seed=4)


@pytest.fixture(scope="module")
def group_params():
    return [_sampled(4, seed=10 * i) for i in range(4)]


@pytest.fixture(scope="module")
def big_cache_groups(tiny_llama, group_prompts, group_params):
    llm = _llm(tiny_llama)
    got, _ = _run(llm, group_prompts, group_params)
    assert llm.stats().num_preemptions == 0
    return got


@pytest.mark.parametrize("preemption_mode", [None, "swap", "recompute"], ids=str)
def test_parallel_sampling_groups_under_pressure(
    tiny_llama, group_prompts, group_params, big_cache_groups, preemption_mode
):
    """n=4 groups (up to 4 x 8 blocks, sharing the prompt's) in a cache that holds about
    one: swapped out and in (the default rule, or forced), or recomputed, where a group's
    samples catch up together; every seeded sample stays the same."""
    llm = _llm(tiny_llama, num_gpu_blocks_override=32, preemption_mode=preemption_mode)
    got, steps = _run(llm, group_prompts, group_params)
    assert got == big_cache_groups
    assert llm.stats().num_preemptions > 0
    num_out, num_in = _num_swaps(steps)
    if preemption_mode == "recompute":
        assert (num_out, num_in) == (0, 0)
    else:
        assert num_out > 0 and num_in > 0
    _assert_idle(llm)


def test_default_rule_swaps_groups_and_recomputes_single_sequences(
    tiny_llama, prompts, group_prompts, group_params, big_cache_groups, hf_outputs
):
    mixed_prompts, mixed_params = [], []
    for i in range(4):  # interleaved: groups and single sequences both become victims
        mixed_prompts += [group_prompts[i], prompts[i]]
        mixed_params += [group_params[i], GREEDY]
    llm = _llm(tiny_llama, num_gpu_blocks_override=32)
    got, steps = _run(llm, mixed_prompts, mixed_params)
    assert got[0::2] == big_cache_groups
    assert got[1::2] == hf_outputs[:4]
    victims = _victims(steps)
    assert any(v.num_live_seqs > 1 for v in victims)
    assert any(v.num_live_seqs == 1 for v in victims)
    for v in victims:
        assert v.is_swapped == (v.num_live_seqs > 1)
        assert v.is_waiting == (v.num_live_seqs == 1)
    _assert_idle(llm)


def test_too_small_swap_space_falls_back_to_recompute(
    tiny_llama, prompts, group_prompts, group_params, big_cache_groups, hf_outputs
):
    # 1e-6 GiB is less than one block: no swap space at all.
    llm = _llm(tiny_llama, num_gpu_blocks_override=32, preemption_mode="swap", swap_space=1e-6)
    assert llm.engine.block_manager.cpu_pool.num_blocks == 0
    got, steps = _run(llm, group_prompts + prompts[:4], group_params + [GREEDY] * 4)
    assert got[:4] == big_cache_groups
    assert got[4:] == hf_outputs[:4]
    assert llm.stats().num_preemptions > 0
    assert _num_swaps(steps) == (0, 0)
    assert all(v.is_waiting for v in _victims(steps))
    _assert_idle(llm)


def _hf_beams(model_dir: Path, prompt: list[int], width: int, max_new_tokens: int):
    """HF beam search's beams, best first (new tokens only; EOS is the model's own)."""
    return [tokens for tokens, _ in hf_beam_search(model_dir, prompt, width, max_new_tokens)]


@pytest.mark.parametrize("preemption_mode", [None, "recompute"], ids=str)
def test_beam_search_under_pressure_matches_hf(tiny_llama, group_prompts, preemption_mode):
    """Width-4 searches in 24 blocks: swapped whole (the default for groups), or recomputed,
    where every beam catches up before any samples again."""
    llm = _llm(tiny_llama, num_gpu_blocks_override=24, preemption_mode=preemption_mode)
    params = SamplingParams(n=4, best_of=4, use_beam_search=True, temperature=0.0, max_tokens=20)
    got, steps = _run(llm, group_prompts, params)
    for i, (prompt, beams) in enumerate(zip(group_prompts, got)):
        assert beams == _hf_beams(tiny_llama, prompt, 4, 20), f"prompt {i}"
    assert llm.stats().num_preemptions > 0
    num_out, num_in = _num_swaps(steps)
    if preemption_mode == "recompute":
        assert (num_out, num_in) == (0, 0)
    else:
        assert num_out > 0 and num_in > 0
    _assert_idle(llm)
