"""Embeddings through the engine (`LLM.embed`, and pooling requests beside generation):
each pooling equals HF's final hidden states pooled the same way, in float32, whether the
prompt is prefilled whole or in chunks, after a prefix-cache hit, or recomputed after a
preemption; a sentence-transformers config sets the defaults; generation in the same
steps is unchanged, and no block is left behind. Also max_tokens 0 with prompt logprobs
(a prompt scored, as echo asks): nothing sampled, the logprobs HF's."""

from __future__ import annotations

import pytest
import torch
from gpu_share import TWO_RANK_DEVICE
from tiny_models import (
    hf_embedding,
    hf_greedy,
    hf_log_softmax,
    random_prompts,
    write_sentence_transformers_config,
)

from serve import LLM, PoolingParams, SamplingParams

ATOL = 1e-5
BUDGET = 16  # max_num_batched_tokens: prompts longer than this are prefilled in chunks
PROMPTS = [
    *random_prompts(512, 1, 100, 100, seed=41),  # 7 chunks
    *random_prompts(512, 3, 2, 15, seed=42),  # one chunk each (alone in a step)
    *random_prompts(512, 1, 37, 37, seed=43),
]


def _llm(model_dir, **kwargs) -> LLM:
    kwargs = {"kv_cache_memory": "8MiB", "swap_space": 0.001, **kwargs}
    return LLM(model=str(model_dir), **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with _llm(tiny_llama, max_num_batched_tokens=BUDGET) as engine:
        yield engine


def _assert_close(got: list[float], expected: torch.Tensor, what: str) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == expected.shape, what
    diff = (got_t - expected).abs().max().item()
    assert diff <= ATOL, f"{what}: differs from HF by {diff:.2e}"


def _assert_idle(llm: LLM) -> None:
    """No request alive: every block is free (cached ones included), ref counts agree."""
    llm.engine.block_manager.check_invariants()
    assert llm.stats().num_blocks_used == 0
    assert llm.engine.block_manager.num_free_blocks == llm.stats().num_blocks_total


@pytest.mark.parametrize(
    ("pooling_type", "normalize"),
    [("last", True), ("mean", True), ("cls", True), ("mean", False), ("last", False)],
)
def test_each_pooling_equals_hf_whole_and_chunked(llm, tiny_llama, pooling_type, normalize):
    params = PoolingParams(pooling_type, normalize)
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        assert out.prompt_token_ids == prompt
        expected = hf_embedding(tiny_llama, prompt, pooling_type, normalize)
        _assert_close(out.outputs.embedding, expected, f"prompt {i} ({len(prompt)} tokens)")
        if normalize:
            assert torch.tensor(out.outputs.embedding).norm().item() == pytest.approx(1.0, abs=1e-5)
    _assert_idle(llm)


def test_the_default_is_last_token_normalised_and_text_is_tokenized(llm, tiny_llama):
    text = "The sea is wide and blue; the sky is high and bright."
    (out,) = llm.embed(text, use_tqdm=False)
    ids = llm.get_tokenizer()(text).input_ids
    assert out.prompt_token_ids == ids
    _assert_close(out.outputs.embedding, hf_embedding(tiny_llama, ids, "last"), "text")
    assert out.outputs.hidden_size == 64


def test_dimensions_are_refused_on_a_model_without_matryoshka(llm):
    with pytest.raises(ValueError, match=r"^dimensions is not supported"):
        llm.embed("Hello", PoolingParams(dimensions=8), use_tqdm=False)
    assert llm.engine.num_unfinished_requests == 0


@pytest.fixture(scope="module")
def st_llama(tiny_model_factory):
    """The tiny llama as a sentence-transformers model: mean pooling, Normalize, and
    Matryoshka truncation allowed by its config."""
    return write_sentence_transformers_config(
        tiny_model_factory("llama", is_matryoshka=True), "mean_tokens", normalize=True
    )


def test_a_sentence_transformers_config_sets_the_defaults_and_flags_override_it(st_llama):
    prompts = PROMPTS[:2]
    with _llm(st_llama, max_num_batched_tokens=BUDGET) as llm:
        assert (llm.engine.pooling.pooling_type, llm.engine.pooling.normalize) == ("mean", True)
        for out, prompt in zip(
            llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False), prompts
        ):
            _assert_close(out.outputs.embedding, hf_embedding(st_llama, prompt, "mean"), "mean")
        (short,) = llm.embed(
            {"prompt_token_ids": prompts[0]}, PoolingParams(dimensions=16), use_tqdm=False
        )
        expected = hf_embedding(st_llama, prompts[0], "mean", dimensions=16)
        _assert_close(short.outputs.embedding, expected, "Matryoshka truncation, then L2")
    with _llm(st_llama, pooling_type="cls", pooling_normalize=False) as llm:
        assert (llm.engine.pooling.pooling_type, llm.engine.pooling.normalize) == ("cls", False)
        (out,) = llm.embed({"prompt_token_ids": prompts[0]}, use_tqdm=False)
        expected = hf_embedding(st_llama, prompts[0], "cls", normalize=False)
        _assert_close(out.outputs.embedding, expected, "flags over the config")


def test_generation_is_unchanged_by_embeddings_in_the_same_steps(llm, tiny_llama, monkeypatch):
    """Greedy generation equals HF's with pooling requests sharing its steps (chunked,
    of every kind); each pooling request is gone from the scheduler, its blocks freed,
    by the step that returns it; nothing is held at the end."""
    scheduler = llm.engine.scheduler
    original = scheduler.schedule
    mixed_steps = 0

    def recording_schedule():
        nonlocal mixed_steps
        out = original()
        groups = {
            scheduler.get_group(scheduler.get_seq(s.seq_id).request_id) for s in out.scheduled
        }
        kinds = {g.sampling_params.is_prefill_only for g in groups}
        mixed_steps += kinds == {True, False}
        return out

    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    gen_prompts = random_prompts(512, 3, 5, 40, seed=51)
    emb_prompts = random_prompts(512, 6, 5, 60, seed=52)
    kinds = ["last", "mean", "cls"]
    for i, prompt in enumerate(gen_prompts):
        llm.add_request(f"g{i}", prompt, greedy)
        pooling = PoolingParams(kinds[i % 3])
        llm.add_request(
            f"e{2 * i}", emb_prompts[2 * i], SamplingParams(max_tokens=0, pooling=pooling)
        )
        pooling = PoolingParams(kinds[(i + 1) % 3])
        llm.add_request(
            f"e{2 * i + 1}", emb_prompts[2 * i + 1], SamplingParams(max_tokens=0, pooling=pooling)
        )
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out
                if out.request_id.startswith("e"):
                    assert scheduler.get_group(out.request_id) is None
                    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
        llm.engine.block_manager.check_invariants()
    assert mixed_steps > 0, "no step held both kinds"
    for i, prompt in enumerate(gen_prompts):
        expected = hf_greedy(tiny_llama, prompt, 12, ignore_eos=True)
        assert finished[f"g{i}"].outputs[0].token_ids == expected, f"generation {i} changed"
    for i, prompt in enumerate(emb_prompts):
        kind = kinds[(i // 2 + i % 2) % 3]
        _assert_close(finished[f"e{i}"].pooled, hf_embedding(tiny_llama, prompt, kind), f"e{i}")
    _assert_idle(llm)


@pytest.mark.parametrize(("pooling_type", "takes_hits"), [("last", True), ("mean", False)])
def test_prefix_cache_hits_only_for_last_token_pooling(llm, tiny_llama, pooling_type, takes_hits):
    (prompt,) = random_prompts(512, 1, 70, 70, seed=60 + takes_hits)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    before = llm.stats().prefix_cache_hits
    (out,) = llm.embed({"prompt_token_ids": prompt}, PoolingParams(pooling_type), use_tqdm=False)
    hits = llm.stats().prefix_cache_hits - before
    assert (hits > 0) == takes_hits, hits
    _assert_close(
        out.outputs.embedding, hf_embedding(tiny_llama, prompt, pooling_type), "after a hit"
    )
    _assert_idle(llm)


def test_mean_pooling_recomputed_after_preemption_equals_hf(tiny_llama):
    """A cache of 10 blocks of 4: a growing generation preempts the embedding (the later
    arrival) mid-prefill; it is recomputed from its first token, pooled afresh."""
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    (gen_prompt,) = random_prompts(512, 1, 6, 6, seed=71)
    (emb_prompt,) = random_prompts(512, 1, 36, 36, seed=72)
    with _llm(
        tiny_llama,
        num_gpu_blocks_override=10,
        block_size=4,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    ) as llm:
        llm.add_request("g", gen_prompt, greedy)
        llm.add_request(
            "e", emb_prompt, SamplingParams(max_tokens=0, pooling=PoolingParams("mean"))
        )
        finished = {}
        while llm.has_unfinished_requests():
            finished.update({o.request_id: o for o in llm.step() if o.finished})
        assert llm.stats().num_preemptions > 0
        assert finished["g"].outputs[0].token_ids == hf_greedy(
            tiny_llama, gen_prompt, 30, ignore_eos=True
        )
        _assert_close(
            finished["e"].pooled, hf_embedding(tiny_llama, emb_prompt, "mean"), "recomputed"
        )
        _assert_idle(llm)


def test_max_tokens_zero_scores_the_prompt(llm, tiny_llama):
    (prompt,) = random_prompts(512, 1, 40, 40, seed=81)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    (completion,) = out.outputs
    assert completion.token_ids == [] and completion.finish_reason == "length"
    assert out.pooled is None
    reference = hf_log_softmax(tiny_llama, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        expected = reference[pos - 1, prompt[pos]].item()
        assert out.prompt_logprobs[pos][prompt[pos]] == pytest.approx(expected, abs=1e-4)
    _assert_idle(llm)


def test_two_ranks_and_the_transformers_backend_pool_as_hf(tiny_llama):
    """The driver pools its full hidden states at TP=2 (each rank's are the same after the
    all-reduce and the final norm); the transformers backend's are its model's own."""
    prompts = PROMPTS[:2]
    batch = [{"prompt_token_ids": p} for p in prompts]
    for settings in (
        {
            "tensor_parallel_size": 2,
            "distributed_executor_backend": "mp",
            "device": TWO_RANK_DEVICE,
        },
        {"model_impl": "transformers"},
    ):
        with _llm(tiny_llama, max_num_batched_tokens=BUDGET, **settings) as llm:
            for pooling_type in ("last", "mean"):
                outs = llm.embed(batch, PoolingParams(pooling_type), use_tqdm=False)
                for out, prompt in zip(outs, prompts, strict=True):
                    expected = hf_embedding(tiny_llama, prompt, pooling_type)
                    _assert_close(out.outputs.embedding, expected, f"{settings} {pooling_type}")
            _assert_idle(llm)
