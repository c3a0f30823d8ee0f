"""What test_families.py's greedy comparison cannot see in Gemma, Granite, Phi-3 and OLMo 2.

- A final soft-cap (Gemma) and `logits_scaling` (Granite) are monotonic: they change the
  logprobs, never the argmax. The prompt logprobs are compared with HF's.
- LongRoPE's long factors. transformers picks the set per forward pass from its last
  position; serve picks it per sequence from the sequence's length this step (rotary.py).
  Exact against HF's `generate`: sequences that stay within the original context, and
  prompts already past it when their first step computes them whole, side by side in one
  batch. A sequence that grows past it while decoding keeps its short-rotated K/V, where
  `generate` recomputes the whole sequence with the long set (Phi-3's
  prepare_inputs_for_generation); what serve does there equals HF's forward with its KV
  cache, step by step, which is checked instead.
- OLMo 2's q/k norms at two ranks with one KV head, which both ranks hold (the
  all-reduced sum of squares counts it twice).
- StableLM's per-head q/k LayerNorms at two ranks, with each head's weights made far apart
  (the tiny models' norms are all near 1, too close for greedy tokens to tell heads apart).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from gpu_share import TWO_RANK_DEVICE
from safetensors.torch import load_file, save_file
from tiny_models import _hf_model, hf_greedy, hf_log_softmax, random_prompts

from serve import LLM, SamplingParams

TOLERANCE = 1e-4


@pytest.mark.parametrize("key", ["gemma2", "gemma3", "granite"])
def test_prompt_logprobs_match_hf_through_logit_transforms(tiny_model_factory, key):
    path = tiny_model_factory(key)
    llm = LLM(model=str(path), max_num_batched_tokens=64, max_model_len=64, kv_cache_memory="8MiB")
    prompt = random_prompts(512, 1, 30, 30, seed=5)[0]
    params = SamplingParams(temperature=0.0, prompt_logprobs=2, max_tokens=1)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    reference = hf_log_softmax(path, prompt)
    for pos in range(1, len(prompt)):
        expected = reference[pos - 1]
        for token_id, logprob in out.prompt_logprobs[pos].items():
            assert logprob == pytest.approx(expected[token_id].item(), abs=TOLERANCE), pos


ORIGINAL = 16  # original_max_position_embeddings of the Phi-3 below: contexts cross it


@pytest.fixture(scope="module")
def long_phi3(tiny_model_factory):
    return tiny_model_factory(
        "phi3", original_max_position_embeddings=ORIGINAL, sliding_window=None
    )


def test_longrope_long_prompts_match_hf_beside_short_ones(long_phi3):
    # Prompts past the original context, computed in one step (long factors throughout),
    # in the same batch as short sequences that stay within it (short throughout).
    long_prompts = random_prompts(512, 3, ORIGINAL + 1, 40, seed=6)
    short_prompts = random_prompts(512, 2, 3, ORIGINAL - 8, seed=7)
    prompts = long_prompts + short_prompts
    llm = LLM(
        model=str(long_phi3), max_num_batched_tokens=256, max_model_len=64, kv_cache_memory="8MiB"
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        expected = hf_greedy(long_phi3, prompt, 8, ignore_eos=True)
        assert out.outputs[0].token_ids == expected, f"prompt {i} (length {len(prompt)})"


def _hf_cached_greedy(model_dir, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's forward with its KV cache, one token at a time, without `generate`'s
    recompute of a Phi-3 sequence that crosses the original context."""
    from transformers import DynamicCache

    model = _hf_model(model_dir)
    cache = DynamicCache(config=model.config)
    ids, new = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits
            new.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[new[-1]]])
    return new


def test_longrope_crossing_while_decoding_matches_hf_forward_with_cache(long_phi3):
    prompts = random_prompts(512, 3, 6, ORIGINAL - 2, seed=8)  # all cross while decoding
    llm = LLM(
        model=str(long_phi3), max_num_batched_tokens=256, max_model_len=64, kv_cache_memory="8MiB"
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    differs_from_generate = False
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        expected = _hf_cached_greedy(long_phi3, prompt, 16)
        assert out.outputs[0].token_ids == expected, f"prompt {i} (length {len(prompt)})"
        differs_from_generate |= expected != hf_greedy(long_phi3, prompt, 16, ignore_eos=True)
    # The gap the module docstring names: generate's recompute changes these continuations.
    assert differs_from_generate


def test_olmo2_with_a_kv_head_on_both_ranks_matches_hf(tiny_model_factory):
    path = tiny_model_factory("olmo2", num_key_value_heads=1)
    prompts = random_prompts(512, 2, 5, 20, seed=10)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(
        model=str(path),
        tensor_parallel_size=2,
        device=TWO_RANK_DEVICE,
        max_model_len=64,
        kv_cache_memory="8MiB",
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8, ignore_eos=True)


def test_stablelm_per_head_norms_at_two_ranks_match_hf(tiny_model_factory, tmp_path):
    path = tmp_path / "stablelm"
    shutil.copytree(tiny_model_factory("stablelm-parallel"), path)
    weights = load_file(path / "model.safetensors")
    for name, tensor in weights.items():
        if "_layernorm.norms." in name:  # ...q_layernorm.norms.{head}.weight
            head = int(name.split(".norms.")[1].split(".")[0])
            weights[name] = tensor * (0.25 + head)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    prompts = random_prompts(512, 2, 5, 20, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(
        model=str(path),
        tensor_parallel_size=2,
        device=TWO_RANK_DEVICE,
        max_model_len=64,
        kv_cache_memory="8MiB",
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8, ignore_eos=True)
