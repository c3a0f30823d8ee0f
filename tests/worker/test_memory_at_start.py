"""Memory at start. On CPU the weights (with oneDNN's packed copies) and the zero-filled KV
cache are checked against the memory available before any weight is read, and the cache
again once the weights are in: past what is free, the OOM killer used to end the engine
without a word. On a GPU, a rank's share of the weights against its free memory."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from serve import LLM
from serve.kernels import cpu
from serve.models.loader import weights_bytes
from serve.worker.model_runner import check_gpu_weights_fit

MiB = 1 << 20
GiB = 1 << 30


def _refuse_loading(*args, **kwargs):
    raise AssertionError("the weights were read before the memory check")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weights_estimate_is_every_parameter_at_the_dtype_they_load_as(tiny_llama, dtype):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    width = torch.empty((), dtype=dtype).element_size()
    assert weights_bytes(tiny_llama, "auto", dtype) == width * sum(
        p.numel() for p in hf.parameters()
    )


def test_a_pickled_checkpoint_has_no_estimate(tiny_llama, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    assert weights_bytes(tmp_path, "auto", torch.float32) is None


def test_weights_that_do_not_fit_are_refused_before_loading(tiny_llama, monkeypatch):
    weights = weights_bytes(tiny_llama, "auto", torch.float32)
    available = 3 * weights // 2  # the weights, not their packed copies
    monkeypatch.setattr("serve.worker.model_runner.available_memory_bytes", lambda: available)
    monkeypatch.setattr("serve.worker.model_runner.load_model", _refuse_loading)
    with pytest.raises(ValueError, match="the weights alone do not fit") as refused:
        LLM(model=str(tiny_llama), device="cpu", kv_cache_memory="4MiB", swap_space=0.001)
    message = str(refused.value)
    assert "in float32, twice that with the packed copy of each linear's" in message
    assert "try --dtype bfloat16 (half the bytes), or SERVE_CPU_PREPACK=0" in message

    with pytest.raises(ValueError, match="the weights alone do not fit") as refused:
        LLM(
            model=str(tiny_llama),
            device="cpu",
            dtype="bfloat16",
            kv_cache_memory="4MiB",
            swap_space=0.001,
        )
    assert "in bfloat16, twice that" in str(refused.value)
    assert "--dtype bfloat16" not in str(refused.value)

    # With no cache to count, the packed copies alone are what does not fit in 1.5x the
    # weights; without them, loading starts.
    with pytest.raises(ValueError, match="the weights alone do not fit"):
        LLM(model=str(tiny_llama), device="cpu", num_gpu_blocks_override=8, swap_space=0.001)
    monkeypatch.setenv(cpu.PREPACK_ENV_VAR, "0")
    cpu.prepack_enabled.cache_clear()
    try:
        with pytest.raises(AssertionError, match="read before the memory check"):
            LLM(model=str(tiny_llama), device="cpu", num_gpu_blocks_override=8, swap_space=0.001)
    finally:
        monkeypatch.delenv(cpu.PREPACK_ENV_VAR)
        cpu.prepack_enabled.cache_clear()


def test_a_cache_past_the_room_the_weights_leave_is_refused_with_a_size_that_fits(
    tiny_llama, monkeypatch
):
    weights = weights_bytes(tiny_llama, "auto", torch.float32)
    available = 2 * weights + 300 * MiB
    monkeypatch.setattr("serve.worker.model_runner.available_memory_bytes", lambda: available)
    with pytest.raises(
        ValueError, match=re.escape("lower the cache, e.g. --kv-cache-memory 240MiB.")
    ):
        LLM(model=str(tiny_llama), device="cpu", kv_cache_memory="1GiB", swap_space=0.001)
    llm = LLM(model=str(tiny_llama), device="cpu", kv_cache_memory="240MiB", swap_space=0.001)
    assert llm.stats().num_blocks_total > 0
    llm.shutdown()


def test_a_cache_larger_than_the_memory_left_once_loaded_is_refused(tiny_llama, monkeypatch):
    # Room for everything by the estimate before loading, less once the weights are in.
    available = iter([1 << 40, 8 * MiB, 1 << 40, 1 << 40])
    monkeypatch.setattr("serve.worker.model_runner.available_memory_bytes", lambda: next(available))
    message = (
        "--kv-cache-memory 16 MiB does not fit in the 8 MiB of memory available now (the "
        "model's weights loaded): lower it, e.g. --kv-cache-memory 6MiB."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(model=str(tiny_llama), device="cpu", kv_cache_memory="16MiB", swap_space=0.001)
    llm = LLM(model=str(tiny_llama), device="cpu", kv_cache_memory="4MiB", swap_space=0.001)  # fits
    assert llm.stats().num_blocks_total > 0
    llm.shutdown()


def test_a_forced_block_count_past_the_memory_is_refused_too(tiny_llama, monkeypatch):
    """--num-gpu-blocks-override sizes the CPU cache by hand: it is checked as well, not
    allocated into the OOM killer (a billion blocks was torch's allocator traceback)."""
    monkeypatch.setattr("serve.worker.model_runner.available_memory_bytes", lambda: 64 * MiB)
    with pytest.raises(ValueError, match=r"--num-gpu-blocks-override 1000000000 takes .* more"):
        LLM(model=str(tiny_llama), device="cpu", num_gpu_blocks_override=10**9, swap_space=0.001)
    llm = LLM(
        model=str(tiny_llama), device="cpu", num_gpu_blocks_override=64, swap_space=0.001
    )  # fits
    assert llm.stats().num_blocks_total == 64
    llm.shutdown()


def test_gpu_weights_past_the_free_memory_are_refused_with_the_gpus_that_would_hold_them():
    cuda = torch.device("cuda", 0)
    check_gpu_weights_fit(30 * GiB, 1, 31 * GiB, torch.bfloat16, cuda)  # fits
    check_gpu_weights_fit(60 * GiB, 2, 31 * GiB, torch.bfloat16, cuda)  # fits, shared out
    message = (
        "The model's weights take 140.0 GiB in bfloat16, 140.0 GiB on each of 1 GPU(s), and "
        "cuda:0 has 78.0 GiB free: try --tensor-parallel-size 2 (70.0 GiB a GPU), or a "
        "smaller model."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        check_gpu_weights_fit(140 * GiB, 1, 78 * GiB, torch.bfloat16, cuda)
    with pytest.raises(ValueError, match=re.escape("--tensor-parallel-size 4 (70.0 GiB a GPU)")):
        check_gpu_weights_fit(280 * GiB, 2, 78 * GiB, torch.float32, cuda)  # 140 a GPU
    with pytest.raises(ValueError, match=re.escape("or --dtype bfloat16 (half the bytes)")):
        check_gpu_weights_fit(280 * GiB, 2, 78 * GiB, torch.float32, cuda)
