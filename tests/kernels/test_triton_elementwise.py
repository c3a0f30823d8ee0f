"""The fused elementwise Triton kernels (RMSNorm, rotary, SiLU-and-mul) against the reference.

The oracle is the reference in float32 on the same inputs (rounded to the tested dtype
first): the kernels compute in float32 and round once, where the reference in bfloat16
rounds after every op, so comparing two roundings would measure the reference's error too.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import TOLERANCE, poisoned_like, rel_err
from kernels.test_reference import make_cos_sin_cache

from serve.kernels import reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def triton_ops():
    from serve.kernels import triton as ops

    return ops


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("hidden", [64, 96])  # 96 pads to 128 lanes
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_reference(triton_ops, device, dtype, hidden, with_residual):
    gen = torch.Generator().manual_seed(hidden)
    x = (3 * torch.randn(13, hidden, generator=gen)).to(dtype)
    residual = torch.randn(13, hidden, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    expected = reference.rms_norm(
        x.float(), weight.float(), 1e-6, None if residual is None else residual.float()
    )
    x, weight = x.to(device), weight.to(device)
    x_before = x.clone()
    out = poisoned_like(x)

    if residual is None:
        result = triton_ops.rms_norm(x, weight, 1e-6, out=out)
        assert result is out
        assert rel_err(out, expected) < TOLERANCE[dtype]
    else:
        residual = residual.to(device)
        residual_before = residual.clone()
        result, summed = triton_ops.rms_norm(
            x, weight, 1e-6, residual, out=out, residual_out=poisoned_like(x)
        )
        assert result is out
        assert rel_err(out, expected[0]) < TOLERANCE[dtype]
        assert rel_err(summed, expected[1]) < TOLERANCE[dtype]
        assert torch.equal(residual, residual_before)
    assert torch.equal(x, x_before)


def test_rms_norm_small_inputs_make_eps_matter(triton_ops, device):
    gen = torch.Generator().manual_seed(1)
    x = 1e-3 * torch.randn(5, 48, generator=gen)
    weight = 1 + 0.1 * torch.randn(48, generator=gen)
    out = triton_ops.rms_norm(x.to(device), weight.to(device), 1e-5)
    assert rel_err(out, reference.rms_norm(x, weight, 1e-5)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "is_neox_style"),
    [(32, 32, True), (64, 16, True), (32, 32, False), (48, 16, False)],
    ids=["neox", "neox-partial", "gptj", "gptj-partial"],
)
def test_rotary_in_place_matches_reference(
    triton_ops, device, dtype, head_dim, rotary_dim, is_neox_style
):
    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    num_tokens, num_heads, num_kv_heads = 7, 9, 3
    positions = torch.tensor([0, 1, 17, 255, 1000, 3, 3])
    cache = make_cos_sin_cache(rotary_dim, 1024, 10000.0)
    # q and k as the attention layer has them: strided views into one qkv projection.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype)
    qkv32 = qkv.float()
    expected_q, expected_k = reference.rotary_embedding(
        positions,
        qkv32[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim),
        qkv32[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
            num_tokens, num_kv_heads, head_dim
        ),
        cache,
        is_neox_style,
    )
    qkv = qkv.to(device)
    qkv_before = qkv.clone()
    query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )

    q_out, k_out = triton_ops.rotary_embedding(
        positions.to(device), query, key, cache.to(device), is_neox_style
    )

    assert q_out is query and k_out is key  # in place
    assert rel_err(query, expected_q) < TOLERANCE[dtype]
    assert rel_err(key, expected_k) < TOLERANCE[dtype]
    # Channels past rotary_dim, position 0 and the value part of qkv are untouched.
    query_before = qkv_before[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    assert torch.equal(query[..., rotary_dim:], query_before[..., rotary_dim:])
    assert torch.equal(qkv[0], qkv_before[0])
    v_start = (num_heads + num_kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:], qkv_before[:, v_start:])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("d", [40, 128])
def test_silu_and_mul_matches_reference(triton_ops, device, dtype, d):
    gen = torch.Generator().manual_seed(d)
    x = (4 * torch.randn(11, 2 * d, generator=gen)).to(dtype)
    expected = reference.silu_and_mul(x.float())
    x = x.to(device)
    out = triton_ops.silu_and_mul(
        x, out=torch.full((11, d), float("nan"), dtype=dtype, device=device)
    )
    assert out.shape == (11, d) and out.dtype == dtype
    assert rel_err(out, expected) < TOLERANCE[dtype]
