"""The same greedy-equality oracle on a CUDA device (float32): run with `-m gpu`."""

from __future__ import annotations

import gc

import pytest
from gpu_share import ENGINE_SHARE
from tiny_models import hf_greedy, random_prompts

from serve import LLM, SamplingParams


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_greedy_matches_hf(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    llm = LLM(model=str(model_dir), device="cuda", dtype="float32", gpu_memory_utilization=0.5)
    runner = llm.engine.executor.worker.model_runner
    assert runner.device.type == "cuda"
    assert next(runner.model.parameters()).is_cuda
    # Profiled: half the GPU (less where test workers share it), less the forward's peak,
    # is KV cache.
    share = ENGINE_SHARE or 0.5
    assert llm.engine.executor.num_blocks * runner.bytes_per_block > 0.6 * share * _gpu_bytes()
    prompts = random_prompts(512, 6, 1, 60, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 24)


def _gpu_bytes() -> int:
    import torch

    return torch.cuda.get_device_properties(0).total_memory


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Each test's engine holds half the GPU as KV cache: free it before the next profiles
    what is left (the engine's objects form cycles, so only a collection frees them)."""
    yield
    import torch

    gc.collect()
    torch.cuda.empty_cache()
