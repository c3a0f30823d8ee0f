"""The native layer stack: a Llama-, Gemma- or GPT-2-style model's layers in one C++ call
on CPU, at steps of one or two tokens (the few-row linear) and of more (the packed
weights). It must change nothing a user sees: the same tokens and the same logprobs, bit
for bit, as the per-layer Python loop, and it must leave alone every model whose layers
compute something it does not."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import random_prompts

from serve import LLM, SamplingParams
from serve.kernels import cpu
from serve.kernels.backend import BACKEND_ENV_VAR, ops_for
from serve.models.native_layer_stack import ENV_VAR, NativeLayerStack, build_layer_stack

VOCAB = 512
# A small KV cache: an engine's default CPU cache is gigabytes, and each test runs two.
ENGINE = {"enable_prefix_caching": False, "block_size": 4, "num_gpu_blocks_override": 64}


def _model(llm: LLM):
    return llm.engine.executor.worker.model_runner.model


def _layers(llm: LLM):
    model = _model(llm)
    body = getattr(model, "model", model)  # GPT-2's, OPT's and GPT-NeoX's sit at the top
    return body.h if hasattr(body, "h") else body.layers


@pytest.fixture
def stack_calls(monkeypatch):
    """The forwards that went through a native stack in this test: (rows in, rows out)."""
    calls = []
    original = NativeLayerStack.__call__

    def counted(self, positions, x):
        out, residual = original(self, positions, x)
        assert residual is None if self.parallel_residual else residual.shape == out.shape
        calls.append((x.shape[0], out.shape[0]))
        return out, residual

    monkeypatch.setattr(NativeLayerStack, "__call__", counted)
    return calls


PROMPTS = random_prompts(VOCAB, 8, 5, 40, seed=11)
# Two prompts decoding together (two-row steps), one alone (one-row steps), then five
# (five-row steps: oneDNN's linears); each run's prompts are one step of their summed length.
RUNS = [PROMPTS[:2], PROMPTS[2:3], PROMPTS[3:]]
MAX_TOKENS = 10


def _decode(llm: LLM) -> list:
    """Each sequence's tokens, top-3 logprobs at every step, and cumulative logprob."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    runs = RUNS
    results = []
    for batch in runs:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        for out in outs:
            seq = out.outputs[0]
            results.append((seq.token_ids, seq.logprobs, seq.cumulative_logprob))
    return results


def _assert_stack_is_the_loop(model_dir: str, engine: dict, monkeypatch, stack_calls) -> None:
    monkeypatch.setenv(ENV_VAR, "0")
    with LLM(model=model_dir, **engine) as llm:
        assert build_layer_stack(_layers(llm)) is None
        looped = _decode(llm)
    assert stack_calls == []
    monkeypatch.delenv(ENV_VAR)
    with LLM(model=model_dir, **engine) as llm:
        stacked = _decode(llm)
    # Every step went through the stack at its rows: each run's prompts, then its decode
    # steps (9 after the first tokens). The five prompts' step returned their five last
    # rows alone (the last layer's MLP for those only); one or two prompts' steps their
    # last rows with the last repeated up to three (a few-row linear's rows are not
    # oneDNN's); decode steps every row.
    expected = []
    for run in RUNS:
        prompt_rows = sum(map(len, run))
        expected.append((prompt_rows, max(len(run), 3)))
        expected += [(len(run), len(run))] * (MAX_TOKENS - 1)
    assert stack_calls == expected
    assert stacked == looped


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        "qwen2",
        "mistral",
        "qwen3",
        "granite",
        "phi3",
        "gemma2",
        "gemma3",
        "gpt2-layer-scaled",
        "gpt-bigcode",
        "opt",
        "opt-bare",
        "gpt-neox",
        "gpt-neox-sequential",
        "stablelm",
    ],
)
def test_stack_gives_the_loop_s_tokens_and_logprobs_exactly(
    tiny_model_factory, monkeypatch, stack_calls, arch, dtype
):
    """Llama (tied head), Qwen2 (QKV biases), Mistral (a sliding window of 12, which the
    40-token prompts cross), Qwen3 (each head's q and k normed), Granite (each block's
    output scaled by the residual multiplier), Phi-3 (LongRoPE's short factors, its own
    head, a window of 12), Gemma 2 (a norm on each block's output, GeGLU, soft-capped
    scores, a local layer with a window of 8 and a global one), Gemma 3 (q/k norms, a
    rope per layer type), GPT-2 (LayerNorm, no rotation, a plain MLP with gelu_new, each
    layer's scores scaled by 1 / (layer + 1)), GPT-BigCode (one KV head, GeLU's tanh
    form), OPT (ReLU, q scaled before attention; bare: norms without weight or bias) and
    GPT-NeoX (rotary on part of each head; attention and MLP side by side, and in turn)
    and StableLM 2 (LayerNorm, partial rotary, q/k/v biases, a gated MLP), in both CPU
    dtypes."""
    _assert_stack_is_the_loop(
        str(tiny_model_factory(arch)), {**ENGINE, "dtype": dtype}, monkeypatch, stack_calls
    )


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_plain_mlp_activations(tiny_model_factory, monkeypatch, stack_calls, activation):
    """GPT-2's block with the other activations a plain MLP takes (an OPT-like ReLU, the
    exact GeLU): the stack computes them as the loop's torch functions do."""
    model_dir = tiny_model_factory("gpt2", activation_function=activation, initializer_range=0.4)
    _assert_stack_is_the_loop(str(model_dir), ENGINE, monkeypatch, stack_calls)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_one_kv_head_s_k_norm(tiny_model_factory, monkeypatch, stack_calls, arch):
    """With one KV head, k cut from the QKV rows is one row a token, apart in memory: its
    norm copies the rows together in the stack as in the loop (the native norm takes
    contiguous rows), and the stack gives the loop's tokens."""
    model_dir = str(tiny_model_factory(arch, num_key_value_heads=1))
    _assert_stack_is_the_loop(model_dir, ENGINE, monkeypatch, stack_calls)


def test_long_rope_past_the_original_context(tiny_model_factory, monkeypatch, stack_calls):
    """Phi-3's LongRoPE (the tiny model's original context: 64): a 70-token prompt rotates
    by the long factors throughout, a 58-token one crosses to them while it decodes, and
    decoding beside each other each sequence keeps its own set, as in the loop."""
    model_dir = str(tiny_model_factory("phi3"))
    prompts = [{"prompt_token_ids": random_prompts(VOCAB, 1, n, n, seed=n)[0]} for n in (58, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)

    def decode() -> list:
        with LLM(model=model_dir, **ENGINE) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    monkeypatch.setenv(ENV_VAR, "0")
    looped = decode()
    monkeypatch.delenv(ENV_VAR)
    stacked = decode()
    assert len(stack_calls) == 12  # the prompts' step, then 11 decode steps
    assert stacked == looped


def test_prompt_logprobs_keep_every_row(tiny_model_factory, monkeypatch, stack_calls):
    """A step that reads every prompt row (prompt logprobs) gets them all back, and the
    same prompt logprobs as the loop."""
    model_dir = str(tiny_model_factory("llama"))
    prompts = [{"prompt_token_ids": p} for p in RUNS[2]]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)

    def prompt_logprobs() -> list:
        with LLM(model=model_dir, **ENGINE) as llm:
            return [o.prompt_logprobs for o in llm.generate(prompts, params, use_tqdm=False)]

    monkeypatch.setenv(ENV_VAR, "0")
    looped = prompt_logprobs()
    monkeypatch.delenv(ENV_VAR)
    stacked = prompt_logprobs()
    rows = sum(map(len, RUNS[2]))
    assert stack_calls == [(rows, rows), (len(prompts), len(prompts))]
    assert stacked == looped


def test_a_long_prompt_s_chunks_return_three_rows(tiny_model_factory, monkeypatch, stack_calls):
    """A 40-token prompt in chunks of 16: the chunks that sample nothing need no row past
    the last attention (three come back, for oneDNN's sake), the last chunk its sampled
    row (repeated up to three); the tokens and logprobs are the loop's."""
    model_dir = str(tiny_model_factory("llama"))
    engine = {**ENGINE, "max_num_batched_tokens": 16, "max_num_seqs": 1}
    prompt = {"prompt_token_ids": random_prompts(VOCAB, 1, 40, 40, seed=12)[0]}
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)

    def decode() -> list:
        with LLM(model=model_dir, **engine) as llm:
            seq = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            return [seq.token_ids, seq.logprobs, seq.cumulative_logprob]

    monkeypatch.setenv(ENV_VAR, "0")
    looped = decode()
    monkeypatch.delenv(ENV_VAR)
    stacked = decode()
    assert stack_calls == [(16, 3), (16, 3), (8, 3), (1, 1), (1, 1)]
    assert stacked == looped


def test_without_packed_weights_the_stack_takes_only_few_row_steps(
    tiny_model_factory, monkeypatch, stack_calls
):
    """`SERVE_CPU_PREPACK=0`: the loop's linears from three rows are torch's, not oneDNN's
    packed ones, which the stack has no other way to run."""
    monkeypatch.setenv(cpu.PREPACK_ENV_VAR, "0")
    cpu.prepack_enabled.cache_clear()
    try:
        with LLM(model=str(tiny_model_factory("llama")), **ENGINE) as llm:
            _decode(llm)
    finally:
        monkeypatch.delenv(cpu.PREPACK_ENV_VAR)
        cpu.prepack_enabled.cache_clear()
    assert stack_calls == [(2, 2)] * (MAX_TOKENS - 1) + [(1, 1)] * (MAX_TOKENS - 1)


@pytest.mark.parametrize(
    "arch",
    [
        "mixtral",  # a sparse MoE block for an MLP
        "olmo2",  # norms after each block, q and k normed across their heads
        "opt-350m",  # post-norm: each block's sum normed
        "stablelm-parallel",  # per-head LayerNorms on q and k; x + attn + mlp, one norm
    ],
)
def test_stack_leaves_layers_it_does_not_compute(tiny_model_factory, stack_calls, arch):
    llm = LLM(model=str(tiny_model_factory(arch)), **ENGINE)
    with llm:
        assert build_layer_stack(_layers(llm)) is None
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert stack_calls == []


def test_reference_backend_keeps_the_reference_ops(tiny_model_factory, monkeypatch, stack_calls):
    """`SERVE_KERNEL_BACKEND=reference` asks for the torch ops: the native stack stays out."""
    monkeypatch.setenv(BACKEND_ENV_VAR, "reference")
    ops_for.cache_clear()
    try:
        with LLM(model=str(tiny_model_factory("llama")), **ENGINE) as llm:
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    finally:
        monkeypatch.delenv(BACKEND_ENV_VAR)
        ops_for.cache_clear()
    assert stack_calls == []


def test_layers_off_the_cpu_get_no_stack(tiny_model_factory, monkeypatch):
    """The stack is a CPU kernel: layers on another device (CUDA; here the meta device) run
    their own forwards, without asking for the CPU's ops. A CUDA machine runs the Triton
    backend without the interpreter, where the CPU's Triton ops would refuse to load."""
    with LLM(model=str(tiny_model_factory("llama")), **ENGINE) as llm:
        layers = _model(llm).model.layers
        assert build_layer_stack(layers) is not None
        off_the_cpu = copy.deepcopy(layers).to("meta")
    monkeypatch.setenv(BACKEND_ENV_VAR, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ops_for.cache_clear()
    try:
        assert build_layer_stack(off_the_cpu) is None
    finally:
        monkeypatch.undo()
        ops_for.cache_clear()


def test_layers_with_attention_sinks_get_no_stack(tiny_model_factory):
    """A sink in one layer's softmax (GPT-OSS) is an option the native call lacks."""
    with LLM(model=str(tiny_model_factory("llama")), **ENGINE) as llm:
        layers = _model(llm).model.layers
        assert build_layer_stack(layers) is not None
        with_sinks = copy.deepcopy(layers)
    attention = with_sinks[-1].self_attn.attn
    attention.sinks = torch.nn.Parameter(torch.zeros(attention.num_heads), requires_grad=False)
    assert build_layer_stack(with_sinks) is None
