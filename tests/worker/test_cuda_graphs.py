"""Decode steps from CUDA graphs (serve/worker/cuda_graphs.py).

Without a GPU, the graphs' "replays" run as eager forwards over the same static buffers and
the same host metadata fixed at capture (`DecodeGraphs(capture=False)`), on the Triton
kernels under the interpreter: whatever a replay would compute differently from a plain
step (a padded row writing the cache, a kernel reading a host value that the capture fixed)
shows here. The `gpu` tests capture and replay real graphs.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from tiny_models import random_prompts

from serve import LLM, SamplingParams
from serve.kernels import backend
from serve.kernels.backend import is_interpreting
from serve.worker.cuda_graphs import DecodeGraphs, capture_sizes, ineligibility
from serve.worker.model_inputs import ModelInputs, QuerySpan, paged_attention_inputs

CPU = torch.device("cpu")
on_the_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not is_interpreting(),
    reason="emulates the graphs on CPU, under Triton's interpreter",
)


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-2:] == [248, 256] and len(sizes) == 35


def test_only_native_models_on_one_cuda_rank_on_triton_are_captured():
    cuda = torch.device("cuda", 0)
    assert "CUDA" in ineligibility("native", 1, CPU)
    assert "tensor parallelism" in ineligibility("native", 2, cuda)
    assert "transformers" in ineligibility("transformers", 1, cuda)


@pytest.mark.parametrize(
    ("family", "quantized", "reader"),
    [
        ("llama", False, None),
        ("mixtral", False, None),  # the fused MoE kernel routes on the device
        ("mixtral", True, "model.layers.0.mlp.experts"),
        ("gpt-oss", False, "model.layers.0.mlp.experts"),
    ],
)
def test_models_whose_experts_run_one_at_a_time_decode_eagerly(
    tiny_model_factory, tmp_path, family, quantized, reader
):
    """Experts that run one at a time (GPT-OSS's; a quantized checkpoint's) count each
    expert's rows on the host every step, which a CUDA graph capture refuses: such a model
    failed to start on a GPU with the default --cuda-graphs. Its decode steps run eagerly,
    with the reason logged."""
    from quantized_models import quantize_checkpoint

    model_dir = tiny_model_factory(family)
    if quantized:
        model_dir, _ = quantize_checkpoint(model_dir, tmp_path, "gptq")
    llm = LLM(model=str(model_dir), device="cpu", kv_cache_memory="4MiB")
    model = llm.engine.executor.worker.model_runner.model
    reason = ineligibility("native", 1, torch.device("cuda", 0), model)
    if reader is None:
        assert reason is None
    else:
        assert reason is not None and reason.startswith(reader) and "host" in reason
    llm.shutdown()


def test_the_reference_backend_is_not_captured(monkeypatch):
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "reference")
    backend.ops_for.cache_clear()
    try:
        assert "reference" in ineligibility("native", 1, torch.device("cuda", 0))
    finally:
        backend.ops_for.cache_clear()


def test_only_decode_steps_the_graphs_hold_are_replayed():
    graphs = DecodeGraphs(torch.nn.Identity(), 8, 2, 4, CPU, capture=False)
    decodes = [[1, 2], [3], [4, 5], [6]]
    assert graphs.size_for(_decode_inputs(decodes[:1], [5], 4)) == 1
    assert graphs.size_for(_decode_inputs(decodes[:3], [5, 2, 8], 4)) == 4
    assert graphs.size_for(_decode_inputs(decodes * 2, [2] * 8, 4)) == 8
    assert graphs.size_for(_decode_inputs(decodes * 2 + [[7]], [2] * 9, 4)) is None  # > 8
    wide = _decode_inputs([[1, 2, 3]], [9], 4)  # longer than the graphs' tables
    assert graphs.size_for(wide) is None
    spans = [QuerySpan([1, 2], 4, 1), QuerySpan([3], 0, 3)]  # a decode and a prompt
    positions, meta = paged_attention_inputs(spans, 4, 1, CPU)
    mixed = ModelInputs(torch.zeros(4, dtype=torch.long), positions, meta, torch.arange(2), [], [])
    assert graphs.size_for(mixed) is None


def test_a_cpu_engine_captures_nothing_and_says_nothing_of_graphs(tiny_llama, caplog):
    """Graphs are on by default; on CPU there is nothing to capture, and no log line about it."""
    with caplog.at_level(logging.DEBUG, logger="serve"):
        llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="4MiB", device="cpu")
    try:
        assert llm.engine.executor.worker.model_runner.graphs is None
        assert "graph" not in caplog.text.lower()
        out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "triton")
    backend.ops_for.cache_clear()
    yield
    backend.ops_for.cache_clear()


def _emulated_graphs(llm: LLM, max_batch: int) -> DecodeGraphs:
    runner = llm.engine.executor.worker.model_runner
    max_blocks = -(-llm.engine.max_model_len // runner.block_size)
    graphs = DecodeGraphs(
        runner.model, max_batch, max_blocks, runner.block_size, runner.device, capture=False
    )
    graphs.capture()
    return graphs


# Families whose forwards differ most: experts (routing on the device), sliding windows,
# soft-capping, ALiBi.
REPLAYED_FAMILIES = ["llama", "mixtral", "gemma2", "bloom"]


@on_the_interpreter
@pytest.mark.parametrize("family", REPLAYED_FAMILIES)
def test_replayed_decodes_give_the_eager_tokens(tiny_model_factory, triton_on_cpu, family):
    """Five sequences decode together (padded to 8), then three (padded to 4, a row that the
    five left behind), two, one: every token and logprob as the eager steps give them."""
    model = tiny_model_factory(family)
    llm = LLM(model=str(model), dtype="float32", kv_cache_memory="4MiB", max_model_len=64)
    try:
        runner = llm.engine.executor.worker.model_runner
        prompts = [{"prompt_token_ids": p} for p in random_prompts(512, 5, 3, 14, seed=5)]
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, logprobs=1, ignore_eos=True)
            for n in (3, 3, 5, 6, 7)
        ]
        eager = llm.generate(prompts, params, use_tqdm=False)
        runner.graphs = _emulated_graphs(llm, max_batch=8)
        replayed = llm.generate(prompts, params, use_tqdm=False)
        assert runner.graphs.replays == 6  # every step after the prompts' own
        for a, b in zip(eager, replayed, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                for token, logprob in x.items():
                    assert y[token] == pytest.approx(logprob, abs=1e-4)
    finally:
        llm.shutdown()


def _decode_inputs(tables: list[list[int]], lengths: list[int], block_size: int) -> ModelInputs:
    spans = [QuerySpan(t, n - 1, 1) for t, n in zip(tables, lengths, strict=True)]
    positions, meta = paged_attention_inputs(spans, block_size, len(spans), CPU)
    ids = torch.tensor([7 + i for i in range(len(spans))])
    return ModelInputs(ids, positions, meta, torch.arange(len(spans)), [], [[]] * len(spans))


@on_the_interpreter
def test_padded_rows_write_nothing_to_the_cache(tiny_llama, triton_on_cpu):
    """A step of three after a step of five replays the size-4 graph, whose fourth row held
    the fifth sequence's slot: only the three sequences' new slots change."""
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="4MiB", max_model_len=64)
    try:
        runner = llm.engine.executor.worker.model_runner
        graphs = _emulated_graphs(llm, max_batch=8)
        bs = runner.block_size
        tables = [[2 * i, 2 * i + 1] for i in range(5)]
        graphs.run(_decode_inputs(tables, [bs + 3] * 5, bs), size=8)
        key_cache = runner.cache_engine.kv_caches[0][0]
        key_cache.normal_()  # a stale row would write what the first step wrote: not this
        before = key_cache.clone()
        lengths = [bs + 4, bs + 5, bs + 6]
        hidden = graphs.run(_decode_inputs(tables[:3], lengths, bs), size=4)
        assert hidden.shape[0] == 3
        changed = (key_cache != before).flatten(2).any(-1).nonzero().tolist()
        assert changed == [[2 * i + 1, n - 1 - bs] for i, n in enumerate(lengths)]
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "mixtral", "gemma2"])
def test_cuda_graphs_give_the_eager_tokens(tiny_model_factory, family):
    """Real captures: the same greedy tokens with and without graphs, over batches that
    shrink as requests finish (each replays a different size). Float32: the graphs' decode
    kernel splits each context for the longest one, the eager one for this step's, and in
    bfloat16 the two roundings may part a near tie."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(512, 6, 3, 40, seed=11)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in range(4, 28, 4)
    ]
    model = tiny_model_factory(family)
    outputs = {}
    for graphs in (False, True):
        llm = LLM(
            model=str(model),
            device="cuda",
            dtype="float32",
            gpu_memory_utilization=0.3,
            max_num_seqs=16,
            cuda_graphs=graphs,
        )
        runner = llm.engine.executor.worker.model_runner
        outputs[graphs] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        if graphs:
            assert runner.graphs is not None and runner.graphs.replays >= 20
        llm.shutdown()
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert outputs[True] == outputs[False]
