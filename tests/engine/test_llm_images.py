"""Images through the offline `LLM`, in vLLM's forms: `generate` with a prompt dict's
`multi_modal_data`, `chat` with `image_url` and `image_pil` parts. Greedy output equals
HF transformers' LLaVA on the same widened prompt and image, token for token; what
cannot pair up (placeholders and images, a text-only model, a bad URL) is a ValueError."""

from __future__ import annotations

import pytest
from image_fixtures import data_url, hf_chat_prompt, widened
from tiny_models import (
    IMAGE_TOKEN,
    build_llava_tokenizer,
    hf_vl_greedy,
    random_image,
)

from serve import LLM, SamplingParams
from serve.config import MultiModalConfig
from serve.engine.image_inputs import ImageInputs

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
IMAGES = [random_image(seed) for seed in (11, 12)]
PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
QUESTION = "What is this?"


@pytest.fixture(scope="module")
def tokenizer():
    return build_llava_tokenizer()


@pytest.fixture(scope="module")
def llm(tiny_llava):
    with LLM(str(tiny_llava), kv_cache_memory="16MiB") as llm:
        yield llm


def check_matches_hf(model_dir, out, prompt_ids: list[int], images: list) -> list[int]:
    assert out.prompt_token_ids == prompt_ids
    tokens = list(out.outputs[0].token_ids)
    assert tokens == hf_vl_greedy(model_dir, prompt_ids, images, MAX_TOKENS)
    return tokens


def test_generate_with_multi_modal_data_matches_hf(llm, tiny_llava, tokenizer):
    """vLLM's prompt dicts: text or token ids, one image or a list of them."""
    two = "USER: <image> or <image>? ASSISTANT:"
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[0]}},
        {"prompt": two, "multi_modal_data": {"image": IMAGES}},
        {
            "prompt_token_ids": tokenizer(PROMPT).input_ids,
            "multi_modal_data": {"image": [IMAGES[1]]},
        },
    ]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    first = check_matches_hf(
        tiny_llava, outs[0], widened(tokenizer, tokenizer(PROMPT).input_ids), IMAGES[:1]
    )
    check_matches_hf(tiny_llava, outs[1], widened(tokenizer, tokenizer(two).input_ids), IMAGES)
    other = check_matches_hf(
        tiny_llava, outs[2], widened(tokenizer, tokenizer(PROMPT).input_ids), IMAGES[1:]
    )
    assert first != other  # another image, another answer
    (again,) = llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    assert list(again.outputs[0].token_ids) == first


@pytest.mark.parametrize("part", ["image_url", "image_pil"])
def test_chat_with_an_image_matches_hf(llm, tiny_llava, tokenizer, part):
    image = IMAGES[0]
    given = (
        {"type": "image_url", "image_url": {"url": data_url(image)}}
        if part == "image_url"
        else {"type": "image_pil", "image_pil": image}
    )
    content = [given, {"type": "text", "text": QUESTION}]
    (out,) = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    expected_prompt = hf_chat_prompt(
        tokenizer, [{"type": "image"}, {"type": "text", "text": QUESTION}]
    )
    check_matches_hf(tiny_llava, out, expected_prompt, [image])


def test_chat_in_the_string_format_puts_the_placeholder_first(llm, tiny_llava, tokenizer):
    """vLLM's string content: the image's placeholder on its own line before the text."""
    content = [{"type": "text", "text": QUESTION}, {"image_url": data_url(IMAGES[1])}]
    (out,) = llm.chat(
        [{"role": "user", "content": content}],
        GREEDY,
        use_tqdm=False,
        chat_template_content_format="string",
    )
    assert f"{IMAGE_TOKEN}\n{QUESTION}" in out.prompt
    check_matches_hf(tiny_llava, out, hf_chat_prompt(tokenizer, f"<image>\n{QUESTION}"), IMAGES[1:])


def test_what_cannot_pair_up_is_a_value_error(llm):
    cases = [
        ({"prompt": PROMPT}, "1 image placeholder .* for 0 images"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": IMAGES}}, "for 2 images"),
        ({"prompt": "Hi", "multi_modal_data": {"image": IMAGES[0]}}, "0 image placeholders"),
        ({"prompt": PROMPT, "multi_modal_data": {"video": [1]}}, "images alone"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": "pixels"}}, "must be a data:"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": 3}}, "a URL or a PIL image"),
    ]
    for prompt, said in cases:
        with pytest.raises(ValueError, match=said):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    with_image = {"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[0]}}
    with pytest.raises(ValueError, match="truncate_prompt_tokens cannot cut"):
        llm.generate(with_image, GREEDY, tokenization_kwargs={"truncate_prompt_tokens": 8})
    file_url = {"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}
    with pytest.raises(ValueError, match="allowed_local_media_path"):
        llm.chat([{"role": "user", "content": [file_url]}], GREEDY, use_tqdm=False)
    assert not llm.has_unfinished_requests()


def test_a_text_only_model_refuses_images(tiny_llama):
    with LLM(str(tiny_llama), kv_cache_memory="16MiB") as text_only:
        with pytest.raises(ValueError, match=f"{tiny_llama.name} takes no images"):
            text_only.generate(
                {"prompt": "Hi", "multi_modal_data": {"image": IMAGES[0]}}, GREEDY, use_tqdm=False
            )
        image_part = {"type": "image_pil", "image_pil": IMAGES[0]}
        with pytest.raises(ValueError, match="takes no images"):
            text_only.chat([{"role": "user", "content": [image_part]}], GREEDY, use_tqdm=False)


def test_the_limit_reaches_the_front_end(tiny_llava, tokenizer):
    """`limit_mm_per_prompt` (and vLLM's `language_model_only`) bound a prompt's images."""
    config = MultiModalConfig(limit_mm_per_prompt={"image": 1})
    images = ImageInputs.for_model(tiny_llava, tokenizer, config)
    ids = tokenizer("<image> <image>").input_ids
    with pytest.raises(ValueError, match=r"at most 1 image\(s\)"):
        images.process(ids, IMAGES)
    assert images.process(ids[:2], IMAGES[:1])[1]  # one is taken
    assert images.placeholder_text == IMAGE_TOKEN
