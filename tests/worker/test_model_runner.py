"""The model runner's start on CPU: the work a first request would otherwise pay is done
before the engine reports ready."""

from __future__ import annotations

import pytest
import torch

from serve import LLM
from serve.models.layers.embedding import ParallelLMHead
from serve.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

LINEARS = (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def test_cpu_linears_are_packed_at_start(tiny_llama):
    """A CPU linear of three rows and more runs on a packed copy of its weight (float32:
    the native kernel's panels), made on first use (serve/kernels/cpu). The start-up
    forward makes every one, so the first request with a few sequences does not."""
    llm = LLM(model=str(tiny_llama), device="cpu", dtype="float32", kv_cache_memory="4MiB")
    model = llm.engine.executor.worker.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, LINEARS)]
    assert len(linears) == 4 * len(model.model.layers) + 1
    for layer in linears:
        packed, version = layer.weight._serve_packed
        assert version == layer.weight._version
        assert packed.dtype == torch.float32
    llm.shutdown()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # learned positions; a rotary table
def test_the_profiled_forward_keeps_every_position_inside_the_models_context(
    tiny_model_factory, arch
):
    """On a GPU the KV cache is sized after a forward of a whole step's tokens (8,192 by
    default), more than a model's context (the tiny models': 512). It runs as prompts no
    longer than the context, every row's logits computed. As one prompt, its positions ran
    past the position tables: on an H100 a device-side assert or an illegal memory access
    at start, which poisoned the process."""
    llm = LLM(model=str(tiny_model_factory(arch)), device="cpu", kv_cache_memory="4MiB")
    runner = llm.engine.executor.worker.model_runner
    logits = runner._dummy_forward(1300)  # 512 + 512 + 276
    assert logits.shape[0] == 1300
    assert torch.isfinite(logits).all()
    llm.shutdown()


def test_the_profiled_step_is_the_engines_budget_where_the_cache_shortens_the_context(
    tiny_llama,
):
    """Chunked prefill off, --max-num-batched-tokens 64 and a cache of 64 tokens: the
    engine core fits max_model_len to the cache (64, not the model's 512), so the budget is
    taken. The GPU profile's step is that budget too, though it runs before the core fits
    max_model_len, when the longest sequence it knows of is 512 tokens."""
    llm = LLM(
        model=str(tiny_llama),
        device="cpu",
        enable_chunked_prefill=False,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=16,
        block_size=4,
        swap_space=0.001,
    )
    assert (llm.engine.max_model_len, llm.engine.max_num_batched_tokens) == (64, 64)
    assert llm.engine.executor.worker.model_runner._step_tokens_at_most() == 64
    llm.shutdown()
