"""Kernel dispatch: serve's CPU ops on CPU, Triton on CUDA, SERVE_KERNEL_BACKEND to force either;
and the whole engine on the Triton kernels, token for token equal to HF."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from kernel_cases import TOLERANCE, make_attention_inputs, rel_err
from tiny_models import hf_greedy, random_prompts

from serve import LLM, SamplingParams, kernels
from serve.kernels import backend, cpu, reference

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def decide_afresh(monkeypatch):
    """The choice is made once per device and kept; each test sets the variable first, so
    it is decided again from what the test set, and again after the test has restored it."""
    backend.ops_for.cache_clear()
    yield
    backend.ops_for.cache_clear()


def test_the_choice_is_kept_once_made(monkeypatch):
    monkeypatch.delenv(backend.BACKEND_ENV_VAR, raising=False)
    assert backend.ops_for(CPU) is cpu
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "reference")
    assert backend.ops_for(CPU) is cpu  # not read again at every call
    backend.ops_for.cache_clear()
    assert backend.ops_for(CPU) is reference


def test_cpu_tensors_use_the_cpu_ops_by_default(monkeypatch):
    monkeypatch.delenv(backend.BACKEND_ENV_VAR, raising=False)
    assert backend.ops_for(CPU) is cpu
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "auto")
    backend.ops_for.cache_clear()
    assert backend.ops_for(CPU) is cpu


def test_reference_can_be_forced(monkeypatch):
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "reference")
    assert backend.ops_for(CPU) is reference
    assert backend.ops_for(torch.device("cuda")) is reference  # no GPU needed to decide


def test_triton_forced_on_cpu_runs_under_the_interpreter(monkeypatch):
    # Imported first: on a GPU machine, importing with TRITON_INTERPRET=1 set would make
    # every kernel an interpreted one for the rest of the session.
    import serve.kernels.triton  # noqa: F401

    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "triton")
    monkeypatch.setenv(backend.INTERPRETER_ENV_VAR, "1")
    assert backend.ops_for(CPU).__name__ == "serve.kernels.triton"


def test_triton_forced_on_cpu_without_the_interpreter_says_how_to_fix_it(monkeypatch):
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "triton")
    monkeypatch.delenv(backend.INTERPRETER_ENV_VAR, raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.ops_for(CPU)


def test_unknown_backend_is_an_error(monkeypatch):
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="auto, reference, triton"):
        backend.ops_for(CPU)


def test_importing_the_kernels_does_not_load_triton():
    probe = "import sys, serve.kernels; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], timeout=120).returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path under the interpreter")
def test_public_interface_dispatches_to_triton(monkeypatch):
    """`serve.kernels.paged_attention` with Triton forced equals the reference."""
    inputs = make_attention_inputs([(20, 1), (9, 9)], 1, (4, 2), 16, 16, torch.Generator())
    args = (inputs.query, inputs.key_cache, inputs.value_cache, inputs.meta, 0.25)
    expected = kernels.paged_attention(*args)  # CPU default: the native kernel
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "triton")
    backend.ops_for.cache_clear()
    assert rel_err(kernels.paged_attention(*args), expected) < TOLERANCE[torch.float32]


def test_engine_on_triton_kernels_matches_hf_greedy(monkeypatch, tiny_llama, device):
    """The tiny Llama (GQA 4:2, head_dim 16) through `LLM` with every op on Triton (the
    interpreter on a CPU-only machine). A 16-token budget chunks the longer prompts, so
    steps mix decodes, whole prefills and extend chunks over cached blocks."""
    from serve.kernels import triton as triton_ops

    calls = {}
    for name in (
        "paged_attention",
        "reshape_and_cache",
        "rms_norm",
        "rotary_embedding",
        "silu_and_mul",
    ):
        op = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, _counted(op, name, calls))
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "triton")
    llm = LLM(
        model=str(tiny_llama),
        device=device.type,
        dtype="float32",
        kv_cache_memory="1MiB",
        gpu_memory_utilization=0.3,
        max_num_batched_tokens=16,
    )
    prompts = random_prompts(512, 3, 3, 30, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, 8), f"prompt {i}"
    assert set(calls) == {
        "paged_attention",
        "reshape_and_cache",
        "rms_norm",
        "rotary_embedding",
        "silu_and_mul",
    }


def _counted(op, name: str, calls: dict[str, int]):
    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return op(*args, **kwargs)

    return counted
