"""The scheduling policies through the real engine (tiny Llama, float32, CPU): whatever
the order, every output is what it would be alone (greedy equals HF), under preemption,
chunked prefill, prefix hits and steps scheduled ahead; priorities are refused where
they mean nothing; sjf learns from the model's own hidden states."""

from __future__ import annotations

import json

import pytest
from tiny_models import hf_greedy, random_prompts

from serve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SMALL = {"kv_cache_memory": "8MiB", "max_model_len": 64}  # not the 4 GiB default


@pytest.fixture(scope="module")
def prompts():
    # A shared 8-token prefix, so admissions take prefix-cache hits.
    prefix = random_prompts(512, 1, 8, 8, seed=3)[0]
    return [prefix + p for p in random_prompts(512, 8, 6, 24, seed=4)]


@pytest.fixture(scope="module")
def hf_outputs(tiny_llama, prompts):
    return [hf_greedy(tiny_llama, p, 20, ignore_eos=True) for p in prompts]


def _llm(model_dir, **kwargs) -> LLM:
    # 24 blocks x 4 tokens: a few of the 8 requests (up to 52 tokens) fit at once, so
    # requests are preempted; a 16-token budget chunks the prompts.
    return LLM(
        model=str(model_dir),
        block_size=4,
        num_gpu_blocks_override=24,
        max_num_batched_tokens=16,
        max_model_len=64,
        **kwargs,
    )


@pytest.mark.parametrize("policy", ["priority", "sjf"])
def test_outputs_equal_hf_whatever_runs_first(tiny_llama, prompts, hf_outputs, policy):
    llm = _llm(tiny_llama, scheduling_policy=policy)
    try:
        priority = [i % 3 for i in range(len(prompts))] if policy == "priority" else None
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=priority)
        assert [o.outputs[0].token_ids for o in outputs] == hf_outputs
        assert llm.stats().num_preemptions > 0
        assert llm.stats().num_blocks_used == 0
    finally:
        llm.shutdown()


def test_priority_decides_who_finishes_first(tiny_llama, prompts):
    """One sequence at a time: requests run one by one, lowest priority value first."""
    llm = LLM(model=str(tiny_llama), max_num_seqs=1, scheduling_policy="priority", **SMALL)
    try:
        priority = [5, 1, 3, 0, 4, 2, 7, 6]
        for i, (prompt, p) in enumerate(zip(prompts, priority)):
            llm.add_request(f"r{i}", prompt, GREEDY, priority=p)
        finished = []
        while llm.has_unfinished_requests():
            finished += [out.request_id for out in llm.step() if out.finished]
        assert finished == [f"r{i}" for i in sorted(range(8), key=lambda i: priority[i])]
    finally:
        llm.shutdown()


def test_a_priority_under_another_policy_is_refused(tiny_llama, prompts):
    llm = LLM(model=str(tiny_llama), **SMALL)
    try:
        with pytest.raises(ValueError, match="--scheduling-policy priority"):
            llm.generate(prompts[:2], GREEDY, use_tqdm=False, priority=[0, 1])
        with pytest.raises(ValueError, match="one per prompt"):
            llm.generate(prompts[:2], GREEDY, use_tqdm=False, priority=[0])
        # Nothing was left behind: the engine serves on.
        (out,) = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 20
    finally:
        llm.shutdown()


def test_sjf_learns_from_the_models_hidden_states(tiny_llama, prompts):
    llm = LLM(model=str(tiny_llama), scheduling_policy="sjf", **SMALL)
    try:
        policy = llm.engine.scheduler.policy
        llm.generate(prompts, GREEDY, use_tqdm=False)
        # Each finished request left its prompt features and the hidden state at its last
        # prompt token (the model's hidden size, projected).
        history = list(policy.predictor._history)
        assert len(history) == len(prompts)
        assert all(s.hidden is not None and s.hidden.shape == (32,) for s in history)
        assert [s.length for s in history] == [20] * len(prompts)
        assert llm.stats().sjf_predictor_mae_tokens is None  # 8 requests: still cold
        hidden_size = json.loads((tiny_llama / "config.json").read_text())["hidden_size"]
        assert policy._projection.matrix.shape[0] == hidden_size
    finally:
        llm.shutdown()
