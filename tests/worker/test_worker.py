"""The worker's shutdown: with `uniproc` the process outlives the engine, so the model,
the KV cache and any CUDA graphs must go with it for a next engine to have the memory."""

from __future__ import annotations

import gc
import weakref

from serve import LLM, SamplingParams

SETTINGS = dict(device="cpu", num_gpu_blocks_override=64, block_size=4, swap_space=0.001)


def test_shutdown_frees_the_model_and_kv_cache_while_the_llm_is_still_held(tiny_llama):
    """`llm.shutdown(); llm2 = LLM(...)` on one GPU: the first engine's weights and cache
    stayed allocated (the LLM object still held them), and the second's memory check
    refused it."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(model=str(tiny_llama), **SETTINGS)
    first = llm.generate("The sea is wide", params, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.engine.executor.worker.model_runner
    model = weakref.ref(runner.model)
    key_cache = weakref.ref(runner.cache_engine.kv_caches[0][0])
    del runner
    llm.shutdown()
    gc.collect()
    assert model() is None, "the model's weights outlived shutdown"
    assert key_cache() is None, "the KV cache outlived shutdown"

    second = LLM(model=str(tiny_llama), **SETTINGS)
    again = second.generate("The sea is wide", params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == first
    second.shutdown()
