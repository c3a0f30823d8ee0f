"""The engine's greedy output equals HF transformers' token for token (float32, CPU)."""

from __future__ import annotations

import pytest
from tiny_models import hf_greedy, random_prompts

from serve import LLM, SamplingParams

MAX_TOKENS = 24


def _engine_outputs(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_matches_hf(model_dir, prompts, got, max_tokens: int = MAX_TOKENS):
    for i, (prompt, tokens) in enumerate(zip(prompts, got, strict=True)):
        assert tokens == hf_greedy(model_dir, prompt, max_tokens), f"prompt {i} diverged"


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_length_batch_matches_hf(tiny_model_factory, arch, block_size):
    model_dir = tiny_model_factory(arch)
    llm = LLM(model=str(model_dir), block_size=block_size, kv_cache_memory="8MiB")
    prompts = random_prompts(512, 6, 1, 60, seed=block_size)
    _assert_matches_hf(model_dir, prompts, _engine_outputs(llm, prompts))


@pytest.mark.parametrize(
    "overrides",
    [
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
        # YaRN (Qwen's and DeepSeek's long contexts): the prompts run past the original 32.
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 16,
            }
        },
        {"num_key_value_heads": 1, "tie_word_embeddings": False, "attention_bias": True},
    ],
    ids=["rope-linear", "rope-llama3", "rope-yarn", "mqa-untied-bias"],
)
def test_llama_variants_match_hf(tiny_model_factory, overrides):
    model_dir = tiny_model_factory("llama", **overrides)
    llm = LLM(model=str(model_dir), kv_cache_memory="8MiB")
    prompts = random_prompts(512, 3, 20, 90, seed=7)
    _assert_matches_hf(model_dir, prompts, _engine_outputs(llm, prompts))


def test_requests_joining_mid_decode_match_hf(tiny_llama):
    """Continuous batching: new prompts join while others decode; nobody's tokens change."""
    llm = LLM(model=str(tiny_llama), block_size=4, kv_cache_memory="8MiB")
    prompts = random_prompts(512, 6, 2, 50, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    finished: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or llm.has_unfinished_requests():
        if pending and steps % 3 == 0:  # one new request every third step
            i, prompt = pending.pop(0)
            llm.add_request(f"r{i}", prompt, params)
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        steps += 1
    got = [finished[f"r{i}"] for i in range(len(prompts))]
    _assert_matches_hf(tiny_llama, prompts, got)


def test_chunked_prompts_match_hf(tiny_qwen2):
    """A token budget smaller than the prompts splits them into chunks, mid-block too."""
    llm = LLM(model=str(tiny_qwen2), block_size=4, max_num_batched_tokens=7, kv_cache_memory="8MiB")
    prompts = random_prompts(512, 4, 15, 40, seed=3)
    _assert_matches_hf(tiny_qwen2, prompts, _engine_outputs(llm, prompts))


def test_scheduler_budgets_hold_every_step(tiny_llama, monkeypatch):
    llm = LLM(
        model=str(tiny_llama), max_num_seqs=3, max_num_batched_tokens=20, kv_cache_memory="8MiB"
    )
    scheduler = llm.engine.scheduler
    original = scheduler.schedule
    seen = []

    def checked_schedule():
        out = original()
        assert out.num_seqs <= 3
        assert out.num_batched_tokens <= 20
        scheduler.block_manager.check_invariants()
        seen.append(out.num_seqs)
        return out

    monkeypatch.setattr(scheduler, "schedule", checked_schedule)
    prompts = random_prompts(512, 8, 5, 30, seed=5)
    _assert_matches_hf(tiny_llama, prompts, _engine_outputs(llm, prompts, max_tokens=8), 8)
    assert max(seen) == 3  # the budget was actually reached


def test_eos_stops_like_hf(tiny_model_factory, tiny_llama):
    """Without ignore_eos the engine stops where HF stops. A random model rarely says its
    EOS, so make a token it does say (the 6th of a greedy run) the EOS of the same weights."""
    prompts = random_prompts(512, 4, 3, 12, seed=1)
    eos = hf_greedy(tiny_llama, prompts[0], 6)[5]
    model_dir = tiny_model_factory("llama", eos_token_id=eos)
    llm = LLM(model=str(model_dir), kv_cache_memory="8MiB")
    got = _engine_outputs(llm, prompts, max_tokens=40)
    _assert_matches_hf(model_dir, prompts, got, 40)
    assert got[0][-1] == eos and len(got[0]) <= 6
    assert all(eos not in tokens[:-1] for tokens in got)
