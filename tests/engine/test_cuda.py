"""The same greedy-equality oracle on a CUDA device (float32): run with `-m gpu`."""

from __future__ import annotations

import pytest
from tiny_models import hf_greedy, random_prompts

from serve import LLM, SamplingParams


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_greedy_matches_hf(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    llm = LLM(model=str(model_dir), device="cuda", dtype="float32", gpu_memory_utilization=0.5)
    assert llm.engine.device.type == "cuda"
    assert llm.engine.model_runner.num_blocks > 0
    prompts = random_prompts(512, 6, 1, 60, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 24)
