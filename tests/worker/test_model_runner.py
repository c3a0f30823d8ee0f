"""The model runner's start on CPU: the work a first request would otherwise pay is done
before the engine reports ready."""

from __future__ import annotations

import torch

from serve import LLM
from serve.models.layers.embedding import ParallelLMHead
from serve.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

LINEARS = (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, ParallelLMHead)


def test_cpu_linears_are_reordered_for_onednn_at_start(tiny_llama):
    """oneDNN runs a CPU linear of three rows and more on a copy of its weight reordered
    into its blocked layout, made on first use (serve/kernels/cpu). The start-up forward
    makes every one, so the first request with a few sequences does not."""
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="4MiB")
    model = llm.engine.executor.worker.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, LINEARS)]
    assert len(linears) == 4 * len(model.model.layers) + 1
    for layer in linears:
        packed, version = layer.weight._serve_onednn
        assert version == layer.weight._version
        assert packed.dtype == torch.float32
    llm.shutdown()
