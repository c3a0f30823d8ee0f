"""--kv-cache-dtype: a float32 model's K/V stored in bfloat16 or float16. The same memory
holds twice the blocks, and what changes in the output is the rounding of K and V alone:
the model's own arithmetic stays float32."""

from __future__ import annotations

import pytest
from tiny_models import random_prompts

from serve import LLM, SamplingParams


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


# Logprob error bounds: bfloat16 keeps 8 bits of mantissa, float16 11 (a wrong block read
# or a missed write moves these logprobs by whole units).
TOLERANCE = {"bfloat16": 0.1, "float16": 0.02}


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float16"])
def test_a_16_bit_cache_holds_twice_the_blocks_and_rounds_only_k_and_v(
    tiny_llama, prompt, cache_dtype
):
    exact, num_blocks = prompt_scores(tiny_llama, prompt)
    rounded, narrow_blocks = prompt_scores(tiny_llama, prompt, kv_cache_dtype=cache_dtype)
    assert narrow_blocks in (2 * num_blocks, 2 * num_blocks + 1)  # the same 4 MiB
    diffs = [abs(a - b) for a, b in zip(exact, rounded, strict=True)]
    assert max(diffs) > 0  # the cache's dtype is in effect
    assert max(diffs) < TOLERANCE[cache_dtype], diffs  # its rounding is all that changed


def test_auto_stores_the_models_dtype(tiny_llama, prompt):
    exact, num_blocks = prompt_scores(tiny_llama, prompt)
    assert prompt_scores(tiny_llama, prompt, kv_cache_dtype="auto") == (exact, num_blocks)


def test_a_16_bit_cache_under_a_16_bit_model_of_the_other_kind_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="--kv-cache-dtype float16 needs a float32 model"):
        LLM(model=str(tiny_llama), dtype="bfloat16", kv_cache_dtype="float16")
