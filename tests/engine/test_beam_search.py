"""Beam search equals HF transformers' `generate(num_beams=W)` (float32, CPU): the same
beams in the same order, the same scores, beams ending at EOS included.

A random model rarely says its own EOS, so each architecture gets a twin with the same
weights whose EOS is the token its beams say most often; then beams end at EOS at many
lengths, which exercises finished hypotheses, length penalties and early stopping.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import tiny_models
from tiny_models import random_prompts

from serve import LLM, SamplingParams

MAX_TOKENS = 16
BLOCK_SIZE = 4


def hf_beam_search(
    model_dir: Path,
    prompt: list[int],
    width: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> list[tuple[list[int], float]]:
    return tiny_models.hf_beam_search(
        model_dir, prompt, width, MAX_TOKENS, length_penalty, early_stopping
    )


def _llm(model_dir, **kwargs) -> LLM:
    kwargs = {"block_size": BLOCK_SIZE, "kv_cache_memory": "4MiB", "swap_space": 0.001, **kwargs}
    return LLM(model=str(model_dir), **kwargs)


def _prompts() -> list[dict]:
    # Some of these make greedy search stop at the tiny Llama's EOS twin's EOS early.
    return [{"prompt_token_ids": p} for p in random_prompts(512, 5, 3, 20, seed=1)]


def _eos_twin(tiny_model_factory, arch: str) -> tuple[Path, int]:
    """`arch`'s tiny model again, with EOS set to the token its beams say most often."""
    llm = _llm(tiny_model_factory(arch))
    outs = llm.beam_search(_prompts(), 4, MAX_TOKENS, ignore_eos=True, use_tqdm=False)
    counts = Counter(t for o in outs for c in o.outputs for t in c.token_ids)
    eos = counts.most_common(1)[0][0]
    return tiny_model_factory(arch, eos_token_id=eos), eos


@pytest.fixture(scope="module")
def eos_llama(tiny_model_factory):
    model_dir, eos = _eos_twin(tiny_model_factory, "llama")
    return model_dir, eos, _llm(model_dir)


def _assert_beams_match_hf(model_dir, llm, eos, width, length_penalty, early_stopping):
    prompts = _prompts()
    outs = llm.beam_search(
        prompts,
        width,
        MAX_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        use_tqdm=False,
    )
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        expected = hf_beam_search(
            model_dir, prompt["prompt_token_ids"], width, length_penalty, early_stopping
        )
        assert [c.token_ids for c in out.outputs] == [t for t, _ in expected], f"prompt {i}"
        for c, (tokens, cumulative_logprob) in zip(out.outputs, expected):
            assert c.cumulative_logprob == pytest.approx(cumulative_logprob, abs=1e-4)
            assert c.finish_reason == ("stop" if tokens[-1] == eos else "length")
    manager = llm.engine.block_manager
    manager.check_invariants()
    assert llm.stats().num_blocks_used == 0
    return outs


@pytest.mark.parametrize("early_stopping", [False, True, "never"], ids=str)
@pytest.mark.parametrize("length_penalty", [1.0, -0.5, 2.0])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_beam_search_matches_hf(eos_llama, width, length_penalty, early_stopping):
    model_dir, eos, llm = eos_llama
    _assert_beams_match_hf(model_dir, llm, eos, width, length_penalty, early_stopping)


def test_beams_end_at_eos_and_at_the_length_limit(eos_llama):
    """The EOS twin makes the comparison above cover both kinds of finished beam."""
    _, eos, llm = eos_llama
    outs = llm.beam_search(_prompts(), 4, MAX_TOKENS, use_tqdm=False)
    beams = [c for o in outs for c in o.outputs]
    stopped = [c for c in beams if c.finish_reason == "stop"]
    assert stopped and all(c.token_ids[-1] == eos for c in stopped)
    # The EOS twin's EOS is an ordinary token with text: left out of the text, as sampled
    # outputs leave out their stop token's.
    tokenizer = llm.get_tokenizer()
    assert all(c.text == tokenizer.decode(c.token_ids[:-1]) for c in stopped)
    assert any(len(c.token_ids) < MAX_TOKENS for c in stopped)
    assert any(c.finish_reason == "length" and len(c.token_ids) == MAX_TOKENS for c in beams)
    assert all(eos not in c.token_ids[:-1] for c in beams)


@pytest.mark.parametrize("early_stopping", [False, True], ids=str)
@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_hf_on_qwen2(tiny_model_factory, width, early_stopping):
    model_dir, eos = _eos_twin(tiny_model_factory, "qwen2")
    _assert_beams_match_hf(model_dir, _llm(model_dir), eos, width, 1.0, early_stopping)


def test_beams_fork_and_free_their_blocks(eos_llama):
    """Stepping one width-4 search: ref counts agree every step, beams share blocks, no
    more than 4 beams hold blocks, and everything is released at the end."""
    _, _, llm = eos_llama
    engine, manager = llm.engine, llm.engine.block_manager
    prompt = random_prompts(512, 1, 30, 30, seed=30)[0]
    params = SamplingParams(
        n=4, best_of=4, use_beam_search=True, temperature=0.0, max_tokens=MAX_TOKENS
    )
    llm.reset_peak()
    engine.add_request("beams", prompt, params)
    shared_seen = False
    while engine.has_unfinished_requests():
        engine.step()
        manager.check_invariants()
        assert len(manager.block_tables) <= 4
        shared_seen |= any(
            manager.block_pool.ref_count(b) > 1 for t in manager.block_tables.values() for b in t
        )
    assert shared_seen
    assert llm.stats().num_blocks_used == 0
    per_beam = -(-(30 + MAX_TOKENS) // BLOCK_SIZE)
    assert llm.stats().peak_num_blocks_used < 4 * per_beam


@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, False), (2.0, True)])
def test_generate_with_use_beam_search_equals_beam_search(
    eos_llama, length_penalty, early_stopping
):
    _, _, llm = eos_llama
    prompts = _prompts()
    expected = llm.beam_search(
        prompts,
        4,
        MAX_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        use_tqdm=False,
    )
    expected_beams = [[c.token_ids for c in o.outputs] for o in expected]

    def params(n: int) -> SamplingParams:
        return SamplingParams(
            n=n,
            best_of=4,
            use_beam_search=True,
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )

    outs = llm.generate(prompts, params(4), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == expected_beams
    # n < best_of: the n best beams. Beside sampled requests, in one batch.
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_TOKENS)
    mixed = llm.generate(prompts + prompts, [params(2)] * 5 + [sampled] * 5, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in mixed[:5]] == [b[:2] for b in expected_beams]
    assert [o.outputs[0].index for o in mixed[:5]] == [0] * 5
    top2 = llm.beam_search(
        prompts,
        4,
        MAX_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        num_return_sequences=2,
        use_tqdm=False,
    )
    assert [[c.token_ids for c in o.outputs] for o in top2] == [b[:2] for b in expected_beams]
    llm.engine.block_manager.check_invariants()
    assert llm.stats().num_blocks_used == 0


@pytest.mark.parametrize("num_logprobs", [0, 2, 20])  # 20: more than the 8 candidates
def test_beams_carry_their_tokens_logprobs(eos_llama, num_logprobs):
    """Each returned beam has every output token's logprob (summing to its cumulative
    logprob, which equals HF's score above) and the position's top ones, as sampled
    outputs do; asking for them changes no beam."""
    _, _, llm = eos_llama
    prompts = _prompts()

    def params(**logprobs) -> SamplingParams:
        return SamplingParams(
            n=2, best_of=4, use_beam_search=True, temperature=0.0, max_tokens=MAX_TOKENS, **logprobs
        )

    plain = llm.generate(prompts, params(), use_tqdm=False)
    outs = llm.generate(prompts, params(logprobs=num_logprobs), use_tqdm=False)
    for plain_out, out in zip(plain, outs):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in plain_out.outputs]
        for c in out.outputs:
            assert len(c.logprobs) == len(c.token_ids)
            chosen = [top[t] for t, top in zip(c.token_ids, c.logprobs)]
            assert sum(chosen) == pytest.approx(c.cumulative_logprob, abs=1e-4)
            # every candidate a step ranked from this beam (8 at width 4 with an EOS), or
            # the best num_logprobs when that is more
            assert all(len(top) == max(num_logprobs, 8) for top in c.logprobs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.7},
        {"temperature": 0.0, "top_p": 0.9},
        {"temperature": 0.0, "top_k": 5},
        {"temperature": 0.0, "min_p": 0.1},
        {"temperature": 0.0, "stop": "x"},
        {"temperature": 0.0, "early_stopping": "sometimes"},
        {"temperature": 0.0, "n": 4, "best_of": 2},
    ],
    ids=["temperature", "top_p", "top_k", "min_p", "stop", "early_stopping", "n>best_of"],
)
def test_invalid_beam_search_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**{"use_beam_search": True, "best_of": 4, **kwargs})


def test_invalid_beam_search_calls_raise(eos_llama):
    _, _, llm = eos_llama
    with pytest.raises(ValueError, match="early_stopping"):
        llm.beam_search(_prompts(), 2, MAX_TOKENS, early_stopping="sometimes", use_tqdm=False)
    narrow = _llm(eos_llama[0], max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs"):
        narrow.beam_search(_prompts()[:1], 4, MAX_TOKENS, use_tqdm=False)
    assert not narrow.engine.has_unfinished_requests()
    assert not llm.engine.has_unfinished_requests()


def test_beam_search_matches_hf_over_a_latent_cache(tiny_model_factory):
    """DeepSeek's layers keep K and V in one tensor: a beam's fork copies each shared
    block once, and the beams stay transformers'."""
    model_dir, eos = _eos_twin(tiny_model_factory, "deepseek-v3")
    _assert_beams_match_hf(model_dir, _llm(model_dir), eos, 4, 1.0, False)
