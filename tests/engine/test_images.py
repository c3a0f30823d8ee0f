"""Images in prompts, in the engine: a LLaVA's greedy output equals HF transformers' on
the same widened prompt and pixels, token for token, whatever the batch holds, wherever
chunked prefill cuts an image's run, across preemption and tensor parallelism; the
prefix cache never hands one image's K/V to another.

Prompts go in as the front end makes them (`MultiModalProcessor.process`), through
`LLM.add_request(..., mm_inputs=...)`."""

from __future__ import annotations

import pytest
from gpu_share import TWO_RANK_DEVICE
from image_fixtures import run_in_steps
from tiny_models import (
    LLAVA_TOKENS_PER_IMAGE,
    build_llava_tokenizer,
    hf_vl_greedy,
    make_tiny_llava,
    random_image,
)

from serve import LLM, SamplingParams
from serve.engine.multimodal import MultiModalProcessor
from serve.models.loader import load_hf_config

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
IMAGES = [random_image(seed) for seed in (1, 2, 3)]
# (text, images): one image, another, two in one prompt, none.
CASES = [
    ("hello <image> what is this?", [IMAGES[0]]),
    ("hello <image> what is this?", [IMAGES[1]]),
    ("<image> and then <image>, which is bigger?", [IMAGES[2], IMAGES[0]]),
    ("The quick brown fox jumps over the lazy dog.", []),
]


def _processor(model_dir) -> MultiModalProcessor:
    processor = MultiModalProcessor.from_model(
        model_dir, load_hf_config(model_dir), build_llava_tokenizer()
    )
    assert processor is not None
    return processor


def _prompts(model_dir, cases=CASES):
    processor, tokenizer = _processor(model_dir), build_llava_tokenizer()
    return [processor.process(tokenizer(text)["input_ids"], images) for text, images in cases]


def _run(llm: LLM, prompts, params=GREEDY) -> list:
    return run_in_steps(llm, prompts, params)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _expected(model_dir, cases=CASES) -> list[list[int]]:
    return [
        hf_vl_greedy(model_dir, token_ids, images, MAX_TOKENS)
        for (token_ids, _), (_, images) in zip(_prompts(model_dir, cases), cases)
    ]


@pytest.fixture(scope="module")
def expected(tiny_llava):
    return _expected(tiny_llava)


def test_processor_widens_each_placeholder(tiny_llava):
    """Each `<image>` becomes a run of the image's token count, the text around it kept."""
    tokenizer = build_llava_tokenizer()
    text_ids = tokenizer("<image> and then <image>, which is bigger?")["input_ids"]
    token_ids, mm_inputs = _prompts(tiny_llava, CASES[2:3])[0]
    assert len(token_ids) == len(text_ids) - 2 + 2 * LLAVA_TOKENS_PER_IMAGE
    first, second = mm_inputs
    assert (first.offset, first.length) == (0, LLAVA_TOKENS_PER_IMAGE)
    assert second.offset == text_ids.index(512, 1) - 1 + LLAVA_TOKENS_PER_IMAGE
    assert first.identifier != second.identifier
    # The same pixels, the same identifier.
    again = _prompts(tiny_llava, [("<image>", [IMAGES[2]])])[0][1][0]
    assert again.identifier == first.identifier
    with pytest.raises(ValueError, match="1 image placeholder .* for 2 images"):
        _processor(tiny_llava).process(text_ids[:3], IMAGES[:2])


def test_mixed_batch_matches_hf(tiny_llava, expected):
    """Images, two images, another image and no image, in the same steps."""
    llm = LLM(str(tiny_llava), kv_cache_memory="16MiB")
    got = _tokens(_run(llm, _prompts(tiny_llava)))
    assert got == expected
    assert got[0] != got[1]  # the image is seen: another image, another answer


def test_chunks_cut_inside_images(tiny_llava, expected):
    """A budget of 6 tokens a step cuts every 16-token run across steps: each chunk takes
    its part of the image's embeddings."""
    llm = LLM(str(tiny_llava), max_num_batched_tokens=6, block_size=4, kv_cache_memory="16MiB")
    assert _tokens(_run(llm, _prompts(tiny_llava))) == expected


def test_prefix_cache_keys_blocks_by_image(tiny_llava, expected):
    """The same text with another image reuses only the blocks before the image; the same
    image again reuses the blocks through it."""
    llm = LLM(str(tiny_llava), block_size=4, enable_prefix_caching=True, kv_cache_memory="16MiB")
    prompts = _prompts(tiny_llava)
    (first,) = _run(llm, prompts[:1])
    (other,) = _run(llm, prompts[1:2])
    (same,) = _run(llm, prompts[:1])
    assert _tokens([first, other, same]) == [expected[0], expected[1], expected[0]]
    image = prompts[0][1][0]
    assert other.num_cached_tokens == image.offset // 4 * 4  # the blocks before the image
    assert same.num_cached_tokens > image.end


def test_preemption_recomputes_the_images(tiny_llava, expected):
    """A cache too small for every sequence at once: preempted sequences recompute their
    prompts, images included, and still match."""
    llm = LLM(
        str(tiny_llava),
        block_size=4,
        num_gpu_blocks_override=24,
        max_num_batched_tokens=8,
        preemption_mode="recompute",
    )
    long = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert _tokens(_run(llm, _prompts(tiny_llava) * 2, long)) == expected * 2
    assert llm.engine.scheduler.num_preemptions > 0


def test_tensor_parallel_runs_the_tower_on_each_rank(tiny_llava, expected):
    """Two ranks: the images reach both workers in the step's message; each runs the
    replicated tower, the language model split as it is alone."""
    llm = LLM(
        str(tiny_llava), tensor_parallel_size=2, device=TWO_RANK_DEVICE, kv_cache_memory="16MiB"
    )
    try:
        assert _tokens(_run(llm, _prompts(tiny_llava))) == expected
    finally:
        llm.shutdown()


def test_siglip_tower_and_another_language_model(tmp_path):
    """LLaVA-Interleave's shape: a SigLIP tower (no class token, every output kept) before
    Qwen2 (q/k/v biases), the language model serve's own family class."""
    model_dir = make_tiny_llava(tmp_path / "llava-qwen2", text_arch="qwen2", tower="siglip")
    cases = CASES[:1] + CASES[2:3]
    llm = LLM(str(model_dir), kv_cache_memory="16MiB")
    assert _tokens(_run(llm, _prompts(model_dir, cases))) == _expected(model_dir, cases)


def test_bad_image_inputs_are_refused(tiny_llava, tiny_llama):
    """A text-only model refuses images; a run that is not the image's placeholders, or
    does not fit the prompt, is refused before anything runs."""
    (token_ids, mm_inputs), *_ = _prompts(tiny_llava)
    text_only = LLM(str(tiny_llama), kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="takes no images"):
        text_only.add_request("a", [5, 6, 7] * 10, GREEDY, mm_inputs=mm_inputs)
    llm = LLM(str(tiny_llava), kv_cache_memory="16MiB")
    moved = [5] + token_ids[:-1]  # the run now starts one token later than it says
    with pytest.raises(ValueError, match="placeholder tokens"):
        llm.add_request("b", moved, GREEDY, mm_inputs=mm_inputs)
    with pytest.raises(ValueError, match="does not fit"):
        llm.add_request("c", token_ids[: mm_inputs[0].end - 1], GREEDY, mm_inputs=mm_inputs)
    assert not llm.has_unfinished_requests()
    with pytest.raises(ValueError, match="not supported with a vision-language model"):
        LLM(str(tiny_llava), enable_lora=True)


@pytest.mark.parametrize("budget", [None, 7])
def test_llava_next_runs_follow_the_tile_grid(tmp_path_factory, budget):
    """LLaVA-NeXT: an image's run is its base view, its tiles as one picture cut to its
    aspect, and a newline per row, so images of other shapes take runs of other lengths;
    each matches transformers (whose language model here is untied from the embedding
    by the outer config, though its text_config says tied)."""
    model_dir = tmp_path_factory.getbasetemp() / "tiny-llava-next"
    if not model_dir.exists():
        make_tiny_llava(model_dir, next_tiles=True, seed=5)
    cases = [
        ("hello <image> what is this?", [random_image(1, 40, 32)]),
        ("hello <image> what is this?", [random_image(2, 30, 70)]),
        ("<image> and <image> compare", [random_image(3, 90, 30), random_image(4, 50, 50)]),
        CASES[3],
    ]
    prompts = _prompts(model_dir, cases)
    assert [[item.length for item in mm] for _, mm in prompts] == [[70], [56], [34, 88], []]
    extra = {} if budget is None else {"max_num_batched_tokens": budget, "block_size": 4}
    llm = LLM(str(model_dir), kv_cache_memory="16MiB", **extra)
    assert _tokens(_run(llm, prompts)) == _expected(model_dir, cases)
