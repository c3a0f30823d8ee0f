"""Every model family, greedy token for token against HF transformers (float32, CPU).

One workload per family, through everything that changes how a context reaches attention:
requests arriving while others decode, prompts of mixed lengths chunked by a small token
budget, a prompt whose prefix is already cached, and a KV cache small enough that requests
are preempted and recomputed. Families with a sliding window get contexts longer than it.
Then the same at two tensor-parallel ranks, where the family's heads split.
"""

from __future__ import annotations

import pytest
from gpu_share import TWO_RANK_DEVICE
from model_families import FAMILIES
from tiny_models import hf_greedy, random_prompts

from serve import LLM, SamplingParams

MAX_TOKENS = 12
ENGINE = {
    "block_size": 4,
    "max_num_batched_tokens": 16,  # prompts up to 40 tokens: chunks
    "num_gpu_blocks_override": 28,  # 112 token slots for 7 requests of up to 52: preemption
    "max_model_len": 64,
}


def _workload(family) -> list[list[int]]:
    shared = random_prompts(512, 1, 16, 16, seed=2)[0]
    prompts = random_prompts(512, 5, 3, 40, seed=len(family.key))
    prompts.insert(1, shared + prompts[0][:4])
    prompts.insert(4, shared + prompts[2][:6])  # arrives once the first is cached
    if family.window is not None:  # a context that crosses the window several times over
        prompts.append(random_prompts(512, 1, 3 * family.window, 3 * family.window, seed=9)[0])
    return prompts


def _run_staggered(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """One request joins every second step, while the earlier ones decode."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    finished: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or llm.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, prompt = pending.pop(0)
            llm.add_request(f"r{i}", prompt, params)
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        step += 1
    return [finished[f"r{i}"] for i in range(len(prompts))]


def _assert_matches_hf(model_dir, prompts, got, greedy=None) -> None:
    """`greedy(prompt) -> new token ids`, if given, is the oracle instead of HF's model in
    `model_dir` (test_remote_formats.py: families transformers has no code for)."""
    for i, (prompt, tokens) in enumerate(zip(prompts, got, strict=True)):
        if greedy is not None:
            expected = greedy(prompt)
        else:
            expected = hf_greedy(model_dir, prompt, MAX_TOKENS, ignore_eos=True)
        assert tokens == expected, f"prompt {i} (length {len(prompt)}) diverged"


@pytest.mark.parametrize("family", FAMILIES, ids=[f.key for f in FAMILIES])
def test_greedy_matches_hf(tiny_model_factory, family):
    model_dir = tiny_model_factory(family.key)
    llm = LLM(model=str(model_dir), **ENGINE)
    prompts = _workload(family)
    got = _run_staggered(llm, prompts)
    _assert_matches_hf(model_dir, prompts, got)
    stats = llm.stats()
    assert stats.prefix_cache_hits >= 16, "the shared prefix was not found cached"
    assert stats.num_preemptions >= 1, "the cache was meant to run out"
    assert stats.num_blocks_used == 0


TP2_FAMILIES = [f for f in FAMILIES if f.tp2]


@pytest.mark.parametrize("family", TP2_FAMILIES, ids=[f.key for f in TP2_FAMILIES])
def test_greedy_at_two_ranks_matches_hf(tiny_model_factory, family):
    model_dir = tiny_model_factory(family.key)
    prompts = _workload(family)
    before = _child_pids()
    with LLM(model=str(model_dir), tensor_parallel_size=2, device=TWO_RANK_DEVICE, **ENGINE) as llm:
        got = _run_staggered(llm, prompts)
    # The block's end stopped both ranks: 32 families' leftover ranks would fill the memory.
    assert _child_pids() - before == set()
    _assert_matches_hf(model_dir, prompts, got)


def _child_pids() -> set[int]:
    """This process's descendants, multiprocessing's resource tracker aside."""
    import psutil

    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES, ids=[f.key for f in FAMILIES])
def test_greedy_on_cuda_matches_hf(tiny_model_factory, family):
    """The Triton kernels (attention with each family's options, fused MoE) in float32 on a
    GPU give HF's CPU tokens."""
    model_dir = tiny_model_factory(family.key)
    llm = LLM(model=str(model_dir), device="cuda", dtype="float32", **ENGINE)
    prompts = _workload(family)
    _assert_matches_hf(model_dir, prompts, _run_staggered(llm, prompts))
