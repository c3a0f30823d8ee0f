"""--kv-cache-dtype: a float32 model's K/V stored in bfloat16, float16 or fp8. The same
memory holds two or four times the blocks, and what changes in the output is the rounding
of K and V alone: the model's own arithmetic stays float32."""

from __future__ import annotations

import pytest
from tiny_models import random_prompts

from serve import LLM, SamplingParams
from serve.kernels.cpu import native


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return random_prompts(512, 1, 40, 40, seed=5)[0]


def prompt_scores(model_dir, prompt: list[int], **kwargs) -> tuple[list[float], int]:
    """Each prompt token's logprob, the prompt run in chunks of 16 tokens (later chunks
    attend to earlier ones through the cache); and the cache's block count."""
    llm = LLM(
        model=str(model_dir),
        kv_cache_memory="4MiB",
        swap_space=0.001,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        **kwargs,
    )
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    scores = [out.prompt_logprobs[p][prompt[p]] for p in range(1, len(prompt))]
    num_blocks = llm.stats().num_blocks_total
    llm.shutdown()
    return scores, num_blocks


# Logprob error bounds by the bits of mantissa kept: bfloat16 8, float16 11, fp8 e4m3 4,
# e5m2 3 (a wrong block read or a missed write moves these logprobs by whole units). And
# how many times the float32 cache's blocks fit in the same memory.
TOLERANCE = {"bfloat16": 0.1, "float16": 0.02, "fp8": 0.5, "fp8_e5m2": 0.8}
BLOCKS_PER_FLOAT32_BLOCK = {"bfloat16": 2, "float16": 2, "fp8": 4, "fp8_e5m2": 4}


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16", "fp8", "fp8_e5m2"])
def test_a_narrower_cache_holds_more_blocks_and_rounds_only_k_and_v(
    tiny_llama, prompt, cache_dtype
):
    exact, num_blocks = prompt_scores(tiny_llama, prompt)
    rounded, narrow_blocks = prompt_scores(tiny_llama, prompt, kv_cache_dtype=cache_dtype)
    times = BLOCKS_PER_FLOAT32_BLOCK[cache_dtype]
    assert times * num_blocks <= narrow_blocks < times * (num_blocks + 1)  # the same 4 MiB
    diffs = [abs(a - b) for a, b in zip(exact, rounded, strict=True)]
    assert max(diffs) > 0  # the cache's dtype is in effect
    assert max(diffs) < TOLERANCE[cache_dtype], diffs  # its rounding is all that changed
    if native.available():  # the torch reference kernels round K/V the same way
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(native, "available", lambda: False)
            oracle, _ = prompt_scores(tiny_llama, prompt, kv_cache_dtype=cache_dtype)
        assert rounded == pytest.approx(oracle, abs=1e-4)


def test_auto_stores_the_models_dtype(tiny_llama, prompt):
    exact, num_blocks = prompt_scores(tiny_llama, prompt)
    assert prompt_scores(tiny_llama, prompt, kv_cache_dtype="auto") == (exact, num_blocks)


def test_a_16_bit_cache_under_a_16_bit_model_of_the_other_kind_is_refused(tiny_llama):
    with pytest.raises(
        ValueError, match="--kv-cache-dtype float16 is no narrower than the model's bfloat16"
    ):
        LLM(model=str(tiny_llama), dtype="bfloat16", kv_cache_dtype="float16")


def test_fp8_blocks_swap_out_and_back_unchanged(tiny_llama):
    """fp8 blocks move as bytes (torch's CPU index ops have no fp8 kernels): requests
    preempted by swapping finish as they do in a cache where nothing is preempted."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(512, 8, 10, 30, seed=21)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(**kwargs) -> tuple[list[list[int]], int]:
        llm = LLM(
            model=str(tiny_llama),
            block_size=4,
            swap_space=0.001,
            kv_cache_dtype="fp8",
            enable_prefix_caching=False,
            **kwargs,
        )
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        preemptions = llm.stats().num_preemptions
        llm.shutdown()
        return [o.outputs[0].token_ids for o in outs], preemptions

    roomy, none = run(kv_cache_memory="4MiB")
    squeezed, preemptions = run(num_gpu_blocks_override=24, preemption_mode="swap")
    assert none == 0 and preemptions > 0
    assert squeezed == roomy
