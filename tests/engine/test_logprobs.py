"""Logprobs and prompt logprobs equal HF transformers' log_softmax (float32), position by
position, and come in the shapes vLLM returns."""

from __future__ import annotations

import pytest
from tiny_models import hf_log_softmax, random_prompts

from serve import LLM, SamplingParams
from serve.engine.validation import check_params

TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tiny_model_factory):
    path = tiny_model_factory(request.param)
    # A small step budget splits the longest prompt over several steps.
    llm = LLM(model=str(path), kv_cache_memory="8MiB", swap_space=0.001, max_num_batched_tokens=32)
    return path, llm


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(512, 4, 5, 60, seed=21)


def test_greedy_logprobs_equal_hf_log_softmax(model, prompts):
    path, llm = model
    params = SamplingParams(temperature=0.0, logprobs=5, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        reference = hf_log_softmax(path, prompt + completion.token_ids)
        for i, (token, top) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = reference[len(prompt) - 1 + i]
            # The sampled token is the most likely one, and its logprob is the top-1's.
            assert top[token] == max(top.values())
            assert top[token] == pytest.approx(row.max().item(), abs=TOLERANCE)
            assert top[token] == pytest.approx(row[token].item(), abs=TOLERANCE)
            expected_top = row.topk(5)
            for tid, lp in zip(expected_top.indices.tolist(), expected_top.values.tolist()):
                assert top[tid] == pytest.approx(lp, abs=TOLERANCE)
        assert completion.cumulative_logprob == pytest.approx(
            sum(top[t] for t, top in zip(completion.token_ids, completion.logprobs)), abs=1e-3
        )


def test_a_mixed_batch_computes_logprobs_only_where_needed(model, prompts):
    """Seeded samples in the same steps, one asking for logprobs and one not: the asking
    one's equal HF's; the other gets none and no cumulative logprob (as vLLM reports it),
    and both sample the same tokens as when both ask."""
    path, llm = model
    batch = [{"prompt_token_ids": p} for p in prompts[:2]]

    def sampling(seed: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            temperature=1.0, seed=seed, logprobs=logprobs, max_tokens=10, ignore_eos=True
        )

    asked, silent = (
        o.outputs[0] for o in llm.generate(batch, [sampling(3, 2), sampling(4, None)], False)
    )
    both = [o.outputs[0] for o in llm.generate(batch, [sampling(3, 2), sampling(4, 0)], False)]
    assert [asked.token_ids, silent.token_ids] == [c.token_ids for c in both]
    assert silent.logprobs is None and silent.cumulative_logprob is None
    assert both[1].cumulative_logprob == pytest.approx(
        sum(top[t] for t, top in zip(both[1].token_ids, both[1].logprobs))
    )
    reference = hf_log_softmax(path, prompts[0] + asked.token_ids)
    for i, (token, top) in enumerate(zip(asked.token_ids, asked.logprobs, strict=True)):
        assert top[token] == pytest.approx(
            reference[len(prompts[0]) - 1 + i][token].item(), abs=TOLERANCE
        )
    assert asked.cumulative_logprob == pytest.approx(
        sum(top[t] for t, top in zip(asked.token_ids, asked.logprobs)), abs=1e-3
    )


def test_prompt_logprobs_equal_hf_log_softmax(model, prompts):
    """Every prompt token but the first, including prompts computed over several steps."""
    path, llm = model
    params = SamplingParams(temperature=0.0, prompt_logprobs=3, max_tokens=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        reference = hf_log_softmax(path, prompt)
        for pos in range(1, len(prompt)):
            entry, row = out.prompt_logprobs[pos], reference[pos - 1]
            assert entry[prompt[pos]] == pytest.approx(row[prompt[pos]].item(), abs=TOLERANCE)
            top = row.topk(3)
            for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert entry[tid] == pytest.approx(lp, abs=TOLERANCE)
            assert len(entry) in (3, 4)  # the top 3, plus the prompt token if not among them


def test_prompt_logprobs_survive_a_prefix_cache_hit(model, prompts):
    """A prompt already in the prefix cache is computed again when its logprobs are asked
    for: no position comes back missing."""
    path, llm = model
    prompt = {"prompt_token_ids": prompts[3]}
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    with_logprobs = SamplingParams(temperature=0.0, prompt_logprobs=0, max_tokens=1)
    first = llm.generate(prompt, with_logprobs, use_tqdm=False)[0].prompt_logprobs
    again = llm.generate(prompt, with_logprobs, use_tqdm=False)[0].prompt_logprobs
    assert len(first) == len(prompts[3]) and first[0] is None
    reference = hf_log_softmax(path, prompts[3])
    for pos in range(1, len(prompts[3])):
        token = prompts[3][pos]
        assert first[pos][token] == pytest.approx(reference[pos - 1][token].item(), abs=TOLERANCE)
    assert again == first


def _rank_bounds(row, token: int) -> tuple[int, int]:
    """`token`'s rank in HF's distribution `row` as vLLM counts it (the tokens whose
    logprob is >= its own, itself included), as bounds: a token within TOLERANCE of it
    may fall on either side of it in serve's float32 arithmetic."""
    logprob = row[token].item()
    return int((row > logprob + TOLERANCE).sum()) + 1, int((row >= logprob - TOLERANCE).sum())


def test_a_sampled_token_outside_the_top_ones_has_its_rank_in_the_vocabulary(model, prompts):
    """vLLM gives the sampled token its true rank, whatever `logprobs` asked for: sampled
    hot with logprobs=1, most tokens are not the top one, and each one's rank is HF's
    count of the tokens at least as likely; the top entry's rank is 1."""
    path, llm = model
    params = SamplingParams(temperature=5.0, seed=7, logprobs=1, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
    num_outside = 0
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        reference = hf_log_softmax(path, prompt + completion.token_ids)
        for i, (token, entries) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            row = reference[len(prompt) - 1 + i]
            low, high = _rank_bounds(row, token)
            assert low <= entries[token].rank <= high, (i, token)
            best = max(entries, key=entries.__getitem__)
            assert entries[best].rank == 1
            if len(entries) == 2:  # the sampled token is not the top one
                num_outside += 1
                assert entries[token].rank > 1
    assert num_outside >= 6


def test_greedy_logprobs_0_ranks_the_chosen_token_first(model, prompts):
    """logprobs=0: each entry is the chosen token alone, the most likely: rank 1."""
    _, llm = model
    params = SamplingParams(temperature=0.0, logprobs=0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)
    completion = out.outputs[0]
    for token, entries in zip(completion.token_ids, completion.logprobs, strict=True):
        assert list(entries) == [token] and entries[token].rank == 1


def test_prompt_logprobs_rank_each_prompt_token(model, prompts):
    """Every prompt token's rank in HF's distribution, as vLLM counts it, wherever it
    falls; the top ones are ranked 1, 2 by their order."""
    path, llm = model
    params = SamplingParams(temperature=0.0, prompt_logprobs=2, max_tokens=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
    num_outside = 0
    for prompt, out in zip(prompts, outs):
        reference = hf_log_softmax(path, prompt)
        assert out.prompt_logprobs[0] is None
        for pos in range(1, len(prompt)):
            entries, token = out.prompt_logprobs[pos], prompt[pos]
            low, high = _rank_bounds(reference[pos - 1], token)
            assert low <= entries[token].rank <= high, pos
            ranked = sorted(entries.values(), key=float, reverse=True)
            assert [lp.rank for lp in ranked[:2]] == [1, 2]
            num_outside += entries[token].rank > 2
    assert num_outside > 0


def test_no_prompt_logprobs_unless_asked(model, prompts):
    _, llm = model
    out = llm.generate(
        {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert out[0].prompt_logprobs is None
    assert out[0].outputs[0].logprobs is None


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_more_logprobs_than_the_server_allows_is_refused(model, prompts, field):
    _, llm = model
    with pytest.raises(ValueError, match=rf"^{field} asks for 21 .*--max-logprobs"):
        llm.generate(prompts[0], SamplingParams(**{field: 21}), use_tqdm=False)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_more_logprobs_than_the_vocabulary_is_refused(field):
    """With --max-logprobs above the vocabulary, a request for more alternatives than there
    are tokens was a 500 (the sampler's top-k past the row); now it is refused up front."""
    with pytest.raises(ValueError, match=rf"^{field} asks for 515 .*vocabulary has 512 tokens"):
        check_params(SamplingParams(**{field: 515}), vocab_size=512, max_logprobs=600)
    check_params(SamplingParams(**{field: 512}), vocab_size=512, max_logprobs=600)
