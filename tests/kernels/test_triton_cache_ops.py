"""The Triton cache writes and block moves against the torch reference.

Caches start as NaN or random data; every element must end exactly as the reference leaves
it (these ops move data, they do no arithmetic), NaN included where nothing is written.
"""

from __future__ import annotations

import pytest
import torch
from kernels.test_reference import random_cache

from serve.kernels import reference


@pytest.fixture(scope="module")
def triton_ops():
    from serve.kernels import triton as ops

    return ops


def assert_identical(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("layout", ["contiguous", "heads_first"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_matches_reference(triton_ops, device, block_size, layout):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 3, 40, 21
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, 20]] = -1  # e.g. padding tokens: written nowhere
    # k and v as the attention layer has them: views into one fused qkv projection.
    qkv = torch.randn(num_tokens, (4 + 2 * num_kv_heads) * head_dim, generator=gen)
    key = qkv[:, 4 * head_dim : (4 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, -1)
    value = qkv[:, (4 + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, -1)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = random_cache(shape, layout, gen).fill_(float("nan")).to(device)
    value_cache = random_cache(shape, layout, gen).fill_(float("nan")).to(device)
    expected_k, expected_v = key_cache.cpu().clone(), value_cache.cpu().clone()

    triton_ops.reshape_and_cache(
        key.to(device), value.to(device), key_cache, value_cache, slots.to(device)
    )

    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    assert_identical(key_cache, expected_k)
    assert_identical(value_cache, expected_v)


def test_reshape_and_cache_casts_to_the_cache_dtype(triton_ops, device):
    gen = torch.Generator().manual_seed(7)
    key, value = torch.randn(5, 2, 64, generator=gen), torch.randn(5, 2, 64, generator=gen)
    slots = torch.tensor([3, 17, -1, 0, 31])
    key_cache = torch.full((2, 16, 2, 64), float("nan"), dtype=torch.bfloat16)
    value_cache = torch.full((2, 16, 2, 64), float("nan"), dtype=torch.bfloat16)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    key_cache, value_cache = key_cache.to(device), value_cache.to(device)

    triton_ops.reshape_and_cache(
        key.to(device), value.to(device), key_cache, value_cache, slots.to(device)
    )

    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    if device.type == "cuda":
        assert_identical(key_cache, expected_k)
        assert_identical(value_cache, expected_v)
    else:
        # The interpreter truncates float32 -> bfloat16 where a GPU rounds to nearest: one ulp.
        for actual, expected in ((key_cache, expected_k), (value_cache, expected_v)):
            torch.testing.assert_close(actual, expected, rtol=2**-7, atol=0, equal_nan=True)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_reshape_and_cache_saturates_into_fp8(triton_ops, device, cache_dtype):
    """--kv-cache-dtype fp8: values past the format's range are stored as its largest
    finite value (e4m3fn has no infinity, so a plain cast would make NaN)."""
    gen = torch.Generator().manual_seed(8)
    key, value = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    key[0, 0, :2] = torch.tensor([6e4, -6e4])
    slots = torch.tensor([5, -1, 2])
    caches = [torch.zeros(2, 4, 2, 16, dtype=cache_dtype, device=device) for _ in range(2)]
    expected = [torch.zeros(2, 4, 2, 16, dtype=cache_dtype) for _ in range(2)]

    triton_ops.reshape_and_cache(key.to(device), value.to(device), *caches, slots.to(device))

    reference.reshape_and_cache(key, value, *expected, slots)
    limit = torch.finfo(cache_dtype).max
    assert caches[0].flatten(0, 1)[5, 0, :2].float().tolist() == [limit, -limit]
    if device.type == "cuda":
        for actual, wanted in zip(caches, expected):
            assert torch.equal(actual.cpu().view(torch.uint8), wanted.view(torch.uint8))
    # The interpreter's fp32 -> fp8 conversion drops the carry of a rounded-up mantissa
    # (1.98 -> 1.0 in e4m3), so off a GPU only the saturation and the slots are checked.
    written = caches[1].flatten(0, 1).float().abs().sum(dim=(1, 2)).cpu()
    assert written.nonzero().flatten().tolist() == [2, 5]


def test_reshape_and_cache_all_skipped_writes_nothing(triton_ops, device):
    key_cache = torch.full((2, 16, 1, 16), float("nan"), device=device)
    value_cache = torch.full((2, 16, 1, 16), float("nan"), device=device)
    kv = torch.randn(3, 1, 16, device=device)
    slots = torch.full((3,), -1, dtype=torch.long, device=device)
    triton_ops.reshape_and_cache(kv, kv, key_cache, value_cache, slots)
    assert key_cache.isnan().all() and value_cache.isnan().all()


@pytest.mark.parametrize("layout", ["contiguous", "heads_first"])
def test_copy_blocks_matches_reference(triton_ops, device, layout):
    gen = torch.Generator().manual_seed(3)
    shape = (10, 16, 2, 24)
    kv_caches = [
        (random_cache(shape, layout, gen), random_cache(shape, layout, gen)) for _ in range(3)
    ]
    src, dst = torch.tensor([4, 0, 4, 7]), torch.tensor([1, 9, 3, 8])
    expected = [(k.clone(), v.clone()) for k, v in kv_caches]
    on_device = [(k.to(device), v.to(device)) for k, v in kv_caches]

    triton_ops.copy_blocks(on_device, src.to(device), dst.to(device))

    reference.copy_blocks(expected, src, dst)
    for (k, v), (k_exp, v_exp) in zip(on_device, expected):
        assert_identical(k, k_exp)
        assert_identical(v, v_exp)


def test_gather_then_scatter_blocks(triton_ops, device):
    from serve.kernels.triton.cache_ops import gather_blocks, scatter_blocks

    gen = torch.Generator().manual_seed(4)
    cache = random_cache((8, 16, 3, 20), "heads_first", gen).to(device)
    ids = torch.tensor([6, 1, 3], device=device)
    staged = gather_blocks(cache, ids)
    assert staged.is_contiguous() and staged.shape == (3, 16, 3, 20)
    assert_identical(staged, cache.index_select(0, ids))

    target = torch.full((5, 16, 3, 20), float("nan"), device=device)
    scatter_blocks(staged, target, torch.tensor([4, 0, 2], device=device))
    assert_identical(target[[4, 0, 2]], staged)
    assert target[[1, 3]].isnan().all()


def test_swap_blocks_matches_reference(triton_ops, device):
    """Out to the CPU swap space and back; on a CPU-only machine both sides are CPU."""
    gen = torch.Generator().manual_seed(5)
    shape = (8, 16, 2, 32)
    device_cache = random_cache(shape, "contiguous", gen).to(device)
    swap_space = torch.full((6, 16, 2, 32), float("nan"))
    expected_swap = swap_space.clone()
    src, dst = torch.tensor([2, 7, 5]), torch.tensor([0, 4, 1])

    triton_ops.swap_blocks(device_cache, swap_space, src.to(device), dst)
    reference.swap_blocks(device_cache.cpu(), expected_swap, src, dst)
    assert_identical(swap_space, expected_swap)

    back = torch.full(shape, float("nan"), device=device)
    triton_ops.swap_blocks(swap_space, back, dst, torch.tensor([3, 0, 6], device=device))
    assert_identical(back[[3, 0, 6]], device_cache[[2, 7, 5]])
    assert back[[1, 2, 4, 5, 7]].isnan().all()
