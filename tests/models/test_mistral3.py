"""Mistral 3 (Pixtral tower): an image's run is rows of `[IMG]` each ended by
`[IMG_BREAK]`, the last by `[IMG_END]`; only the `[IMG]` tokens take embeddings. Greedy
output equals transformers' token for token, whole and with chunks cut anywhere in a run
(between rows too)."""

from __future__ import annotations

import pytest
from image_fixtures import run_in_steps
from tiny_models import MISTRAL3_TOKENS, hf_vl_greedy, make_tiny_mistral3, random_image

from serve import LLM, SamplingParams
from serve.engine.multimodal import MultiModalProcessor
from serve.models.loader import load_hf_config
from serve.models.tokenizer import load_tokenizer

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# 40x30 pixels: 2 rows of 3 tokens (a token per 14 pixels), 8 in the run with the breaks.
CASES = [
    ("hello [IMG] what is this?", [random_image(1, 40, 30)]),
    ("hello [IMG] what is this?", [random_image(2, 70, 20)]),
    ("[IMG] and [IMG], compare them", [random_image(3, 90, 60), random_image(4, 50, 50)]),
    ("no image here at all", []),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_mistral3(tmp_path_factory.mktemp("tiny-mistral3"))


def _prompts(model_dir):
    tokenizer = load_tokenizer(model_dir)
    processor = MultiModalProcessor.from_model(model_dir, load_hf_config(model_dir), tokenizer)
    assert processor is not None
    return [processor.process(tokenizer(text)["input_ids"], ims) for text, ims in CASES]


def test_runs_hold_row_breaks_that_take_no_embedding(model_dir):
    tokenizer = load_tokenizer(model_dir)
    image, row_break, end = tokenizer.convert_tokens_to_ids(list(MISTRAL3_TOKENS))
    token_ids, (item,) = _prompts(model_dir)[0]
    run = token_ids[item.offset : item.end]
    assert run == [image] * 3 + [row_break] + [image] * 3 + [end]
    assert item.is_embed is not None
    assert item.is_embed.numpy().tolist() == [t == image for t in run]
    assert item.num_embeds == 6


@pytest.mark.parametrize("budget", [None, 5])
def test_mistral3_matches_hf(model_dir, budget):
    prompts = _prompts(model_dir)
    extra = {} if budget is None else {"max_num_batched_tokens": budget, "block_size": 4}
    llm = LLM(str(model_dir), kv_cache_memory="16MiB", **extra)
    got = [list(out.outputs[0].token_ids) for out in run_in_steps(llm, prompts, GREEDY)]
    expected = [
        hf_vl_greedy(model_dir, token_ids, ims, MAX_TOKENS)
        for (token_ids, _), (_, ims) in zip(prompts, CASES)
    ]
    assert got == expected
    assert expected[0] != expected[1]


def test_a_run_whose_mask_lets_the_breaks_take_embeddings_is_refused(model_dir):
    import dataclasses

    (token_ids, (item,)), *_ = _prompts(model_dir)
    llm = LLM(str(model_dir), kv_cache_memory="16MiB")
    unmasked = dataclasses.replace(item, is_embed=None)
    with pytest.raises(ValueError, match="placeholder tokens"):
        llm.add_request("a", token_ids, GREEDY, mm_inputs=(unmasked,))
    assert not llm.has_unfinished_requests()
