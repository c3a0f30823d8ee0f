"""Tensor parallelism on the CPU: two gloo ranks (the `mp` executor, and `ray` when it is
installed) give what one rank gives, and greedy output equals HF transformers.

One mixed workload per model, arriving in waves: greedy requests (some sharing a prefix),
seeded `n=3` samples (swapped out under pressure), seeded `best_of`, a beam search and a
JSON schema, through a cache small enough to preempt by recompute and by swap and a token
budget small enough to chunk prompts. Llama and Qwen2, each with 2 KV heads (split over
the ranks) and 1 (replicated on both).
"""

from __future__ import annotations

import json

import pytest
from gpu_share import TWO_RANK_DEVICE
from tiny_models import hf_beam_search, hf_greedy, random_prompts

from serve import LLM, SamplingParams
from serve.sampling_params import StructuredOutputsParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}
ENGINE = {
    "block_size": 4,
    "num_gpu_blocks_override": 40,  # 160 tokens for ~18 requests: preemption
    "swap_space": 0.002,
    "max_num_batched_tokens": 24,  # prompts up to 40 tokens: chunks
    "max_model_len": 128,
    "device": TWO_RANK_DEVICE,  # one rank runs here too: seeded samples are compared
}
CASES = [("llama", 2), ("llama", 1), ("qwen2", 2), ("qwen2", 1)]


def _workload() -> list[tuple[list[int], SamplingParams]]:
    shared = random_prompts(512, 1, 16, 16, seed=3)[0]
    prompts = random_prompts(512, 18, 4, 24, seed=5)
    work: list[tuple[list[int], SamplingParams]] = []
    for i, prompt in enumerate(prompts):
        kind = i % 6
        if kind in (0, 1):
            work.append((shared + prompt, GREEDY))  # later ones find it cached
        elif kind == 2:
            params = SamplingParams(n=3, temperature=0.9, seed=i, max_tokens=MAX_TOKENS)
            work.append((prompt, params))
        elif kind == 3:
            params = SamplingParams(n=1, best_of=3, temperature=1.0, seed=i, max_tokens=8)
            work.append((prompt, params))
        elif kind == 4 and i % 12 == 10:  # every logits control, in the worker
            params = SamplingParams(
                temperature=0.0,
                max_tokens=MAX_TOKENS,
                min_tokens=4,
                repetition_penalty=1.3,
                frequency_penalty=0.5,
                logit_bias={17: 5.0, 40: -100.0},
                bad_words=["the", "a"],
                logprobs=3,
            )
            work.append((prompt, params))
        elif kind == 4:
            beams = SamplingParams(n=3, best_of=3, use_beam_search=True, temperature=0.0)
            beams.max_tokens = 6
            work.append((prompt, beams))
        else:
            grammar = StructuredOutputsParams(json=SCHEMA)
            params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=grammar)
            work.append((prompt, params))
    return work


def run_workload(llm: LLM) -> dict:
    """Every request's completions, added in waves of three between steps, and what the
    scheduler did on the way."""
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    seen = {"swapped_blocks": 0, "chunks": 0}

    def recording_schedule():
        out = schedule()
        seen["swapped_blocks"] += len(out.blocks_to_swap_out)
        seen["chunks"] += sum(not s.is_sampled for s in out.scheduled)
        return out

    scheduler.schedule = recording_schedule
    work = _workload()
    finished = {}
    try:
        for i, (prompt, params) in enumerate(work):
            llm.add_request(f"r{i}", prompt, params)
            if i % 3 == 2:
                for out in llm.step():
                    if out.finished:
                        finished[out.request_id] = out
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.finished:
                    finished[out.request_id] = out
    finally:
        del scheduler.schedule
    manager = llm.engine.block_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks
    outputs = [finished[f"r{i}"] for i in range(len(work))]
    assert all(out.error is None for out in outputs)
    return {
        "work": work,
        "tokens": [[c.token_ids for c in out.outputs] for out in outputs],
        "texts": [[c.text for c in out.outputs] for out in outputs],
        "preemptions": scheduler.num_preemptions,
        "prefix_hits": llm.stats().prefix_cache_hits,
        **seen,
    }


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{k}kv" for a, k in CASES])
def runs(request, tiny_model_factory):
    arch, num_kv_heads = request.param
    model_dir = tiny_model_factory(arch, num_key_value_heads=num_kv_heads)
    one = run_workload(LLM(model=str(model_dir), **ENGINE))
    llm = LLM(model=str(model_dir), tensor_parallel_size=2, **ENGINE)
    try:
        assert llm.engine.config.parallel.executor_backend == "mp"
        two = run_workload(llm)
    finally:
        llm.shutdown()
    return model_dir, one, two


def test_the_workload_preempts_swaps_chunks_and_hits_the_prefix_cache(runs):
    _, _, two = runs
    assert two["preemptions"] > 0 and two["swapped_blocks"] > 0 and two["chunks"] > 0
    assert two["prefix_hits"] > 0


def test_greedy_equals_hf_at_tp2(runs):
    model_dir, _, two = runs
    for (prompt, params), tokens in zip(two["work"], two["tokens"]):
        if params is GREEDY:
            assert tokens == [hf_greedy(model_dir, prompt, MAX_TOKENS, ignore_eos=True)]


def test_beams_equal_hf_at_tp2(runs):
    model_dir, _, two = runs
    beams = [(p, t) for (p, params), t in zip(two["work"], two["tokens"]) if params.use_beam_search]
    assert beams
    for prompt, tokens in beams:
        assert tokens == [t for t, _ in hf_beam_search(model_dir, prompt, 3, 6)]


def test_every_output_equals_one_ranks(runs):
    """Seeded samples (n=3, best_of), beams, logits controls and the JSON schema: token
    for token."""
    _, one, two = runs
    assert two["tokens"] == one["tokens"]
    assert two["texts"] == one["texts"]
    for (_, params), texts in zip(two["work"], two["texts"]):
        if params.structured_outputs is not None:
            value = json.loads(texts[0])
            assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool)


def test_speculation_at_tp2_equals_one_rank_and_keeps_greedy_tokens(runs, tiny_model_factory):
    """The workload with n-gram speculation: two ranks take exactly the tokens one rank
    takes (the driver's accepted proposals reach the other rank), and every greedy
    request's tokens are those without speculation."""
    model_dir, plain, _ = runs
    if model_dir != tiny_model_factory("llama", num_key_value_heads=2):
        pytest.skip("one model is enough: the speculation is the same for every one")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    one = run_workload(LLM(model=str(model_dir), speculative_config=spec, **ENGINE))
    llm = LLM(model=str(model_dir), tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    try:
        two = run_workload(llm)
        drafts = llm.stats().spec_decode
    finally:
        llm.shutdown()
    assert drafts is not None and drafts.num_accepted_tokens > 0, drafts
    assert two["tokens"] == one["tokens"]
    for (_, params), tokens, expected in zip(one["work"], one["tokens"], plain["tokens"]):
        if params.temperature == 0.0 and not params.use_beam_search:
            assert tokens == expected


# -- Ray ------------------------------------------------------------------------------------


def test_ray_executor_runs_the_workload_as_one_rank_does(local_ray, tiny_model_factory):
    model_dir = tiny_model_factory("qwen2", num_key_value_heads=1)
    one = run_workload(LLM(model=str(model_dir), **ENGINE))
    llm = LLM(
        model=str(model_dir), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE
    )
    try:
        two = run_workload(llm)
    finally:
        llm.shutdown()
    assert two["tokens"] == one["tokens"]
    for (prompt, params), tokens in zip(two["work"], two["tokens"]):
        if params is GREEDY:
            assert tokens == [hf_greedy(model_dir, prompt, MAX_TOKENS, ignore_eos=True)]


# -- configurations that cannot work ----------------------------------------------------------


def test_a_split_that_does_not_divide_the_heads_is_refused_naming_the_numbers(tiny_llama):
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size 3 must divide num_attention_heads 4"
    ):
        LLM(model=str(tiny_llama), tensor_parallel_size=3)


def test_more_ranks_than_gpus_is_refused_naming_the_numbers():
    from serve.engine.validation import check_gpu_count

    check_gpu_count(2, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .* has 2 GPUs"):
        check_gpu_count(4, 2)
