"""Per-request sampling controls end to end on the tiny Llama: logit_bias, min_tokens,
allowed_token_ids, bad_words and the penalties (repetition against HF's `generate`)."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import random_prompts

from serve import LLM, SamplingParams

EOS = 0  # the tiny tokenizer's <|endoftext|>


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), kv_cache_memory="8MiB", swap_space=0.001)


@pytest.fixture(scope="module")
def prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(512, 4, 4, 20, seed=21)]


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, logit_bias={77: 100.0}, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, logit_bias={77: 100.0}, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.5, top_p=0.9, seed=3, logit_bias={77: 100.0}, max_tokens=8),
    ],
    ids=["greedy", "sampled", "seeded-top-p"],
)
def test_large_logit_bias_makes_every_token_that_token(llm, prompts, params):
    assert _tokens(llm, prompts, params) == [[77] * 8] * len(prompts)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_holds_back_eos_then_lets_it_through(llm, prompts, temperature):
    pushed = {"temperature": temperature, "seed": 4, "logit_bias": {EOS: 100.0}, "max_tokens": 12}
    assert _tokens(llm, prompts, SamplingParams(**pushed)) == [[EOS]] * len(prompts)
    outs = llm.generate(prompts, SamplingParams(**pushed, min_tokens=5), use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 6 and completion.finish_reason == "stop"
        assert EOS not in completion.token_ids[:5] and completion.token_ids[5] == EOS


def test_min_tokens_holds_back_stop_token_ids(llm, prompts):
    params = SamplingParams(
        temperature=0.0, logit_bias={90: 100.0}, stop_token_ids=[90], min_tokens=3, max_tokens=10
    )
    for out in llm.generate(prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        assert len(completion.token_ids) == 4 and 90 not in completion.token_ids[:3]
        assert completion.stop_reason == 90


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_allowed_token_ids_restrict_the_output(llm, prompts, temperature):
    allowed = [5, 40, 41, 200, 311, 400]
    params = SamplingParams(
        temperature=temperature, allowed_token_ids=allowed, max_tokens=20, ignore_eos=True
    )
    outputs = _tokens(llm, prompts, params)
    assert all(set(tokens) <= set(allowed) for tokens in outputs)
    if temperature:
        assert len({t for tokens in outputs for t in tokens}) > 2  # really sampled


def test_allowed_tokens_that_min_tokens_holds_back_are_refused(llm, prompts):
    """Only EOS and stop tokens allowed, and min_tokens holding them back: no token could
    be generated, so the request is refused rather than given a token outside the set."""
    for allowed, stops in (([EOS], []), ([EOS, 90], [90])):
        params = SamplingParams(allowed_token_ids=allowed, stop_token_ids=stops, min_tokens=2)
        with pytest.raises(ValueError, match="allowed_token_ids"):
            llm.generate(prompts[:1], params, use_tqdm=False)
    # One more allowed token is enough: the first two tokens are it.
    params = SamplingParams(
        temperature=0.0, allowed_token_ids=[EOS, 90, 41], stop_token_ids=[90], min_tokens=2
    )
    tokens = _tokens(llm, prompts[:1], params)[0]
    assert tokens[:2] == [41, 41] and set(tokens) <= {EOS, 90, 41}


def test_ignore_eos_makes_eos_an_ordinary_token_under_min_tokens(llm, prompts):
    """As in vLLM: with ignore_eos, EOS stops nothing, so min_tokens does not hold it
    back; only EOS allowed, every token is EOS from the first."""
    params = SamplingParams(
        temperature=0.0, allowed_token_ids=[EOS], min_tokens=3, ignore_eos=True, max_tokens=5
    )
    assert _tokens(llm, prompts[:1], params) == [[EOS] * 5]


def test_allowed_tokens_that_are_all_one_token_bad_words_are_refused(llm, prompts):
    tokenizer = llm.get_tokenizer()
    (spaced,) = tokenizer.encode(" the", add_special_tokens=False)
    doomed = SamplingParams(allowed_token_ids=[spaced], bad_words=["the"], max_tokens=4)
    with pytest.raises(ValueError, match="allowed_token_ids .* are all bad_words"):
        llm.generate(prompts[:1], doomed, use_tqdm=False)
    # One allowed token that is no bad word is enough: every token is it.
    params = SamplingParams(
        temperature=0.0, allowed_token_ids=[spaced, 41], bad_words=["the"], max_tokens=4
    )
    assert _tokens(llm, prompts[:1], params) == [[41] * 4]


def test_bad_words_never_appear(llm, prompts):
    tokenizer = llm.get_tokenizer()
    spaced = tokenizer.encode(" the", add_special_tokens=False)  # one token
    bare = tokenizer.encode("the", add_special_tokens=False)  # two tokens
    assert len(spaced) == 1 and len(bare) == 2
    # Push every piece of "the" so that, unbanned, it is all the model writes.
    pushed = {t: 100.0 for t in spaced + bare}
    base = {"temperature": 1.0, "seed": 7, "logit_bias": pushed, "max_tokens": 24}

    def pairs(tokens):
        return list(zip(tokens, tokens[1:]))

    free = _tokens(llm, prompts, SamplingParams(**base))
    assert any(spaced[0] in tokens for tokens in free)
    assert any(tuple(bare) in pairs(tokens) for tokens in free)

    params = SamplingParams(**base, bad_words=["the"])
    params.update_from_tokenizer(tokenizer)  # what the engine does; idempotent
    banned = _tokens(llm, prompts, params)
    for tokens in banned:
        assert spaced[0] not in tokens and tuple(bare) not in pairs(tokens)
        assert set(tokens) <= set(bare)  # the bias still holds: bare pieces, never in order
        assert "the" not in tokenizer.decode(tokens)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    return model.eval()


def _hf_greedy_with_repetition_penalty(model, prompt: list[int], penalty: float, n: int):
    input_ids = torch.tensor([prompt])
    config = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=n,
        repetition_penalty=penalty,
        eos_token_id=[],  # run to max_new_tokens, as ignore_eos does
        pad_token_id=model.config.pad_token_id,
    )
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_repetition_penalty_equals_hf(llm, prompts, hf_model):
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=16, ignore_eos=True)
    ours = _tokens(llm, prompts, params)
    plain = _tokens(llm, prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert ours != plain  # the penalty changes the output
    for prompt, tokens in zip(prompts, ours):
        ids = prompt["prompt_token_ids"]
        assert tokens == _hf_greedy_with_repetition_penalty(hf_model, ids, 1.3, 16)


MIXED = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={9: 4.0}, max_tokens=12),
    SamplingParams(
        temperature=1.0,
        seed=11,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        max_tokens=12,
        ignore_eos=True,
    ),
    SamplingParams(
        temperature=0.9, top_k=20, seed=12, logit_bias={300: 3.0, 301: -5.0}, max_tokens=12
    ),
    SamplingParams(temperature=1.0, seed=13, max_tokens=12, ignore_eos=True),
    SamplingParams(
        temperature=0.8,
        seed=14,
        allowed_token_ids=list(range(100, 140)),
        min_tokens=4,
        max_tokens=12,
    ),
]


def test_mixed_batch_equals_each_request_alone(llm, prompts):
    """Rows with and without controls in one batch, greedy and seeded: no request's tokens
    depend on its neighbours, whatever their order."""
    batch_prompts = [prompts[i % len(prompts)] for i in range(len(MIXED))]
    alone = [_tokens(llm, [p], params)[0] for p, params in zip(batch_prompts, MIXED)]
    assert _tokens(llm, batch_prompts, MIXED) == alone
    order = [3, 0, 5, 2, 4, 1]
    reordered = _tokens(llm, [batch_prompts[i] for i in order], [MIXED[i] for i in order])
    assert reordered == [alone[i] for i in order]


def test_a_bad_word_past_the_models_vocabulary_bans_nothing(tiny_model_factory):
    """The tiny tokenizer has 512 tokens, this model's logits 256. " sea" is token 393: a
    word the model can never write. Masking it indexed past the logits: the request
    failed on CPU, and on CUDA a device-side assert ended the engine."""
    model = tiny_model_factory("llama", vocab_size=256, check_degenerate=False)
    llm = LLM(model=str(model), num_gpu_blocks_override=64, block_size=4, swap_space=0.001)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.encode(" sea", add_special_tokens=False) == [393]
    prompt = {"prompt_token_ids": random_prompts(256, 1, 8, 8, seed=3)[0]}
    base = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    plain = _tokens(llm, [prompt], SamplingParams(**base))
    assert _tokens(llm, [prompt], SamplingParams(**base, bad_words=["sea"])) == plain
    llm.shutdown()
