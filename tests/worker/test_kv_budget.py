"""The KV cache's size on a GPU (model_runner.cuda_kv_cache_budget): the engine's share
of the device less the forward's peak, and a clear start-up error where other processes
hold what that share needs."""

from __future__ import annotations

import pytest

from serve.worker.model_runner import check_gpu_cache_fits, cuda_kv_cache_budget

GiB = 2**30


def test_the_share_less_the_peak_is_the_cache():
    assert cuda_kv_cache_budget(80 * GiB, 0.9, 2 * GiB, 78 * GiB) == pytest.approx(70 * GiB)


def test_a_gpu_others_hold_is_refused_with_the_utilization_that_fits():
    # 80 GiB device, 10 GiB free: 0.9 asks for 72 GiB. What fits: (9.5 + 2) / 80 = 0.14.
    with pytest.raises(ValueError) as raised:
        cuda_kv_cache_budget(80 * GiB, 0.9, 2 * GiB, 10 * GiB, "cuda:0")
    message = str(raised.value)
    assert "--gpu-memory-utilization 0.9 asks for 72.0 GiB of cuda:0's 80.0 GiB" in message
    assert "only 10.0 GiB is free" in message
    assert message.endswith("Lower --gpu-memory-utilization to 0.14 or less, or free the GPU.")
    assert cuda_kv_cache_budget(80 * GiB, 0.14, 2 * GiB, 10 * GiB) <= 10 * GiB  # it does fit


def test_a_full_gpu_is_refused_without_a_utilization_to_try():
    with pytest.raises(ValueError, match=r"other processes hold the rest\. Free the GPU\.$"):
        cuda_kv_cache_budget(80 * GiB, 0.9, 2 * GiB, 0)


def test_a_gpu_cache_size_past_what_a_step_leaves_is_refused_with_one_that_fits():
    """--kv-cache-memory on a GPU is each GPU's cache, allocated at start: past the room
    the weights and a full step's activations leave, a start-up error names a size that
    fits, instead of an out-of-memory error during the allocation."""
    check_gpu_cache_fits(6 * GiB, 8 * GiB, "cuda:0")  # fits
    with pytest.raises(ValueError, match=r"--kv-cache-memory 12\.0 GiB .* 8\.0 GiB .*6GiB"):
        check_gpu_cache_fits(12 * GiB, 8 * GiB, "cuda:0")
    with pytest.raises(ValueError, match="leave it out"):
        check_gpu_cache_fits(1 << 20, -(1 << 30), "cuda:0")
