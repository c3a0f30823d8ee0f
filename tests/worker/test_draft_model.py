"""Speculative decoding with a draft model (serve/worker/draft_model.py): a draft equal
to the target proposes what the target decodes (every proposal accepted, through chunked
prefill and swapping, whose moves must carry the draft's KV too); a random draft is
mostly rejected, and greedy output stays the tokens of decoding without speculation
through chunking and preemption by recompute; two tensor-parallel ranks propose alike;
bad drafts are refused at start-up, and a draft with a shorter context than the target's
bounds max_model_len (it runs at the target's positions)."""

from __future__ import annotations

import pytest
import torch
from gpu_share import TWO_RANK_DEVICE
from tiny_models import random_prompts

from serve import LLM, SamplingParams
from serve.config import InvalidSettingError

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SMALL = {"block_size": 4, "max_num_batched_tokens": 16}  # prompts up to 40 tokens: chunks


def _spec(draft, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(512, 6, 8, 40, seed=11)


@pytest.fixture(scope="module")
def expected(tiny_llama, prompts):
    llm = LLM(model=str(tiny_llama), block_size=4, kv_cache_memory="8MiB")
    return _generate(llm, prompts)


def _generate(llm: LLM, prompts, params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_all_blocks_free(llm: LLM) -> None:
    manager = llm.engine.block_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks


def test_draft_equal_to_target_has_every_proposal_accepted(tiny_llama, prompts, expected):
    # Parallel samples are swapped out under pressure; greedy requests run beside them.
    llm = LLM(
        model=str(tiny_llama),
        speculative_config=_spec(tiny_llama),
        num_gpu_blocks_override=16,
        swap_space=0.002,
        preemption_mode="swap",
        **SMALL,
    )
    max_swapped = 0
    for i, prompt in enumerate(prompts):
        llm.add_request(f"g{i}", prompt, GREEDY)
    results: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        max_swapped = max(max_swapped, llm.stats().num_swapped)
        llm.engine.block_manager.check_invariants()
    assert [results[f"g{i}"] for i in range(len(prompts))] == expected
    spec = llm.stats().spec_decode
    assert spec is not None and spec.num_draft_tokens > 0
    # Swapped sequences came back with their draft KV: still all accepted.
    assert max_swapped > 0
    assert spec.num_accepted_tokens == spec.num_draft_tokens
    _assert_all_blocks_free(llm)


def test_the_draft_keeps_its_kv_in_the_targets_cache_dtype(tiny_llama, prompts):
    """--kv-cache-dtype covers the draft's cache too: a draft equal to the target rounds
    its K/V as the target does, so every proposal is still accepted."""
    llm = LLM(
        model=str(tiny_llama),
        speculative_config=_spec(tiny_llama),
        kv_cache_dtype="fp8",
        kv_cache_memory="8MiB",
        swap_space=0.002,
        **SMALL,
    )
    _generate(llm, prompts)
    runner = llm.engine.executor.worker.model_runner
    key_cache, value_cache = runner.draft.cache_engine.kv_caches[0]
    assert key_cache.dtype == value_cache.dtype == torch.float8_e4m3fn
    spec = llm.stats().spec_decode
    assert spec is not None and spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens == spec.num_draft_tokens
    _assert_all_blocks_free(llm)


def test_random_draft_keeps_greedy_output_through_chunks_and_preemption(
    tiny_llama, tiny_model_factory, prompts, expected
):
    draft = tiny_model_factory("llama", seed=5, num_hidden_layers=1)
    llm = LLM(
        model=str(tiny_llama),
        speculative_config=_spec(draft),
        num_gpu_blocks_override=24,  # 96 tokens for 6 requests of up to 46: recomputes
        **SMALL,
    )
    assert _generate(llm, prompts) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    spec = llm.stats().spec_decode
    assert spec is not None and spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens < spec.num_draft_tokens / 2
    _assert_all_blocks_free(llm)


def test_sampled_request_accepts_draft_proposals(tiny_llama, prompts):
    llm = LLM(model=str(tiny_llama), speculative_config=_spec(tiny_llama, k=2), **SMALL)
    # Unseeded: a seeded sample does not speculate (its draws must not follow its drafts).
    params = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    outputs = _generate(llm, prompts[:2], params)
    assert [len(tokens) for tokens in outputs] == [16, 16]
    spec = llm.stats().spec_decode
    assert spec is not None and 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    _assert_all_blocks_free(llm)


def test_draft_with_another_vocabulary_is_refused(tiny_llama, tiny_model_factory):
    draft = tiny_model_factory("llama", num_hidden_layers=1, vocab_size=600)
    with pytest.raises(ValueError, match=r"vocabulary of 600 tokens, the target model 512"):
        LLM(model=str(tiny_llama), speculative_config=_spec(draft))


def test_a_draft_with_a_shorter_context_bounds_max_model_len(
    tiny_llama, tiny_model_factory, prompts, expected
):
    """A 64-token draft for a 512-token target: max_model_len is fitted to 64, so no draft
    forward runs past the draft's position table (before, the CPU rotary kernel failed
    the worker with "position 64 out of range", ending the engine)."""
    draft = tiny_model_factory("llama", seed=5, num_hidden_layers=1, max_position_embeddings=64)
    llm = LLM(model=str(tiny_llama), speculative_config=_spec(draft), kv_cache_memory="8MiB")
    assert llm.engine.max_model_len == 64
    # A prompt past the context is refused, as any prompt longer than max_model_len is.
    long_prompt = random_prompts(512, 1, 80, 80, seed=3)[0]
    with pytest.raises(ValueError, match=r"80 tokens.*max_model_len\) is 64"):
        llm.generate({"prompt_token_ids": long_prompt}, GREEDY, use_tqdm=False)
    # Inside it: the greedy tokens of decoding without speculation.
    assert _generate(llm, prompts) == expected
    # Up to its last position (60 + 4 = 64): the output stops there, by length.
    edge_prompt = random_prompts(512, 1, 60, 60, seed=4)[0]
    out = llm.generate({"prompt_token_ids": edge_prompt}, GREEDY, use_tqdm=False)[0].outputs[0]
    plain = LLM(model=str(tiny_llama), kv_cache_memory="8MiB")
    assert (
        out.token_ids
        == _generate(
            plain, [edge_prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        )[0]
    )
    assert out.finish_reason == "length"
    spec = llm.stats().spec_decode
    assert spec is not None and spec.num_draft_tokens > 0
    _assert_all_blocks_free(llm)


def test_max_model_len_past_the_drafts_context_is_refused(tiny_llama, tiny_model_factory):
    draft = tiny_model_factory("llama", seed=5, num_hidden_layers=1, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"max_model_len=128 .*draft model supports \(64"):
        LLM(
            model=str(tiny_llama),
            speculative_config=_spec(draft),
            max_model_len=128,
            kv_cache_memory="8MiB",
        )


def test_missing_draft_is_refused(tiny_llama, tmp_path):
    with pytest.raises((FileNotFoundError, InvalidSettingError), match="draft model"):
        LLM(model=str(tiny_llama), speculative_config=_spec(tmp_path / "no-such-draft"))


def test_draft_under_tensor_parallelism_proposes_alike_on_both_ranks(tiny_llama, prompts, expected):
    # Both ranks run the draft's forwards (collectives); rank 0's argmax is broadcast.
    llm = LLM(
        model=str(tiny_llama),
        speculative_config=_spec(tiny_llama),
        tensor_parallel_size=2,
        device=TWO_RANK_DEVICE,
        kv_cache_memory="8MiB",
        **SMALL,
    )
    try:
        assert _generate(llm, prompts[:3]) == expected[:3]
        spec = llm.stats().spec_decode
        assert spec is not None and spec.num_draft_tokens > 0
        assert spec.num_accepted_tokens == spec.num_draft_tokens
    finally:
        llm.shutdown()
