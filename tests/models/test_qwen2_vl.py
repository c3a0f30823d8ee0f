"""Qwen2-VL and Qwen2.5-VL: greedy output equals transformers' token for token with
images of different sizes (so runs of different lengths), two images in one prompt, and a
text-only prompt in the same steps; with chunks cut inside images and between an image and
the text after it; and the M-RoPE positions continue after the images into the decode."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_share import TWO_RANK_DEVICE
from image_fixtures import run_in_steps
from tiny_models import build_qwen_vl_tokenizer, hf_vl_greedy, make_tiny_qwen2_vl, random_image

from serve import LLM, SamplingParams
from serve.engine.multimodal import MultiModalProcessor
from serve.models.loader import load_hf_config
from serve.models.qwen2_vl import image_positions
from serve.multimodal_inputs import ArrayData, MultiModalInput

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# 70x60 pixels resize to a 4x4 patch grid (4 tokens), 100x50 to 4x8 (8), 120x90 to 6x8 (12).
CASES = [
    (f"hello {IMAGE} what is this?", [random_image(1, 70, 60)]),
    (f"hello {IMAGE} what is this?", [random_image(2, 100, 50)]),
    (f"{IMAGE} and {IMAGE}, compare them", [random_image(3, 60, 60), random_image(4, 120, 90)]),
    ("no image here at all", []),
]


def _run(model_dir, **engine_args) -> tuple[list[list[int]], list[list[int]]]:
    """(serve's, transformers') greedy tokens for CASES, all four in the same steps."""
    tokenizer = build_qwen_vl_tokenizer()
    processor = MultiModalProcessor.from_model(model_dir, load_hf_config(model_dir), tokenizer)
    assert processor is not None
    prompts = [processor.process(tokenizer(text)["input_ids"], ims) for text, ims in CASES]
    llm = LLM(str(model_dir), kv_cache_memory="16MiB", **engine_args)
    try:
        got = [list(out.outputs[0].token_ids) for out in run_in_steps(llm, prompts, GREEDY)]
    finally:
        llm.shutdown()
    expected = [
        hf_vl_greedy(model_dir, token_ids, ims, MAX_TOKENS)
        for (token_ids, _), (_, ims) in zip(prompts, CASES)
    ]
    assert [[item.length for item in mm] for _, mm in prompts] == [[4], [8], [4, 12], []]
    return got, expected


def test_qwen2_vl_matches_hf(tiny_qwen2_vl):
    got, expected = _run(tiny_qwen2_vl)
    assert got == expected
    assert got[0] != got[1]


def test_qwen2_vl_chunks_cut_inside_images(tiny_qwen2_vl):
    got, expected = _run(tiny_qwen2_vl, max_num_batched_tokens=5, block_size=4)
    assert got == expected


def test_qwen2_5_vl_matches_hf(tmp_path):
    """2.5's tower (windowed attention, RMSNorm, gated MLP) before the same language model."""
    got, expected = _run(make_tiny_qwen2_vl(tmp_path / "qwen2.5-vl", version="2.5", seed=1))
    assert got == expected


def _image(offset: int, rows: int, columns: int) -> MultiModalInput:
    grid = {"image_grid_thw": ArrayData.of(np.array([1, 2 * rows, 2 * columns]))}
    return MultiModalInput("image", "x", offset, rows * columns, grid)


def test_positions_follow_the_grid_and_continue_after_it():
    """Text before an image counts on; the image's tokens take (start, start + row,
    start + column); the text after it resumes from start + the longer side; a chunk or a
    decode gets the same positions as the whole."""
    items = (_image(2, 2, 3), _image(9, 1, 1))  # a 2x3 grid at 2, a 1x1 grid at 9
    whole = image_positions(items, 0, 12, merge_size=2)
    assert whole.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 7, 8],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 7, 8],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 8],
    ]
    for start in range(12):  # a chunk from anywhere, one token (a decode) long
        assert image_positions(items, start, 1, 2).tolist() == whole[:, start : start + 1].tolist()
    assert image_positions(items, 20, 1, 2).tolist() == [[17], [17], [17]]


def test_qwen2_vl_tensor_parallel(tiny_qwen2_vl):
    """Two ranks: each computes the same M-RoPE positions and runs the replicated tower."""
    got, expected = _run(tiny_qwen2_vl, tensor_parallel_size=2, device=TWO_RANK_DEVICE)
    assert got == expected


def test_a_string_template_places_an_image_between_its_markers(tiny_qwen2_vl):
    """For a template that takes text, an image part becomes Qwen2-VL's whole marker
    (`<|vision_start|><|image_pad|><|vision_end|>`, as vLLM writes it), not the bare pad."""
    from serve.chat.rendering import render_chat

    tokenizer = build_qwen_vl_tokenizer()
    processor = MultiModalProcessor.from_model(
        tiny_qwen2_vl, load_hf_config(tiny_qwen2_vl), tokenizer
    )
    assert processor.placeholder_text == IMAGE
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "hi"},
            ],
        }
    ]
    text, _ = render_chat(
        tokenizer,
        messages,
        True,
        None,
        content_format="string",
        image_placeholder=processor.placeholder_text,
    )
    assert f"{IMAGE}\nhi" in text


def test_mm_processor_kwargs_bound_an_images_tokens(tiny_qwen2_vl):
    """vLLM's mm_processor_kwargs reach the image processor: the setting's for every
    prompt, a prompt's own over them. A 200x150 image takes 12 tokens under the tiny
    processor's own max_pixels (112*112), 2 under 56*56; the output still equals
    transformers' under the same arguments."""
    image = random_image(7, 200, 150)
    prompt = f"hello {IMAGE} what is this?"
    llm = LLM(
        str(tiny_qwen2_vl), kv_cache_memory="16MiB", mm_processor_kwargs={"max_pixels": 56 * 56}
    )
    tokenizer = build_qwen_vl_tokenizer()
    processor = MultiModalProcessor.from_model(
        tiny_qwen2_vl, load_hf_config(tiny_qwen2_vl), tokenizer
    )
    for kwargs, given, tokens in [
        ({"max_pixels": 56 * 56}, None, 2),  # the setting's
        ({}, {"max_pixels": 112 * 112}, 12),  # the prompt's own, over it
    ]:
        request = {"prompt": prompt, "multi_modal_data": {"image": image}}
        if given is not None:
            request["mm_processor_kwargs"] = given
        (out,) = llm.generate([request], GREEDY, use_tqdm=False)
        token_ids, (item,) = processor.process(
            tokenizer(prompt)["input_ids"], [image], kwargs | (given or {})
        )
        assert item.length == tokens
        assert out.prompt_token_ids == token_ids
        expected = hf_vl_greedy(
            tiny_qwen2_vl, token_ids, [image], MAX_TOKENS, kwargs | (given or {})
        )
        assert list(out.outputs[0].token_ids) == expected
    with pytest.raises(ValueError, match="refused mm_processor_kwargs"):
        bad = {"prompt": prompt, "multi_modal_data": {"image": image}}
        llm.generate([bad | {"mm_processor_kwargs": {"no_such_argument": 1}}], GREEDY)


def test_pixel_bounds_reach_transformers_as_its_size(tiny_qwen2_vl):
    """vLLM's min_pixels / max_pixels become the processor's `size` bounds (transformers 5
    deprecates them as call arguments), keeping the bound not given."""
    import warnings

    processor = MultiModalProcessor.from_model(
        tiny_qwen2_vl, load_hf_config(tiny_qwen2_vl), build_qwen_vl_tokenizer()
    )
    assert processor._call_kwargs({"max_pixels": 4000, "do_resize": True}) == {
        "do_resize": True,
        "size": {"shortest_edge": 56 * 56, "longest_edge": 4000},
    }
    token_id = processor.layout.placeholder_token_id
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation on the way
        _, (item,) = processor.process(
            [5, token_id, 6], [random_image(7, 200, 150)], {"max_pixels": 56 * 56}
        )
    assert item.length == 2
