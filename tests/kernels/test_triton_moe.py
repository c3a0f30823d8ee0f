"""The mixture-of-experts op: the reference against a per-token oracle, the Triton grouped
GEMMs against the reference, on fresh random inputs (Triton's interpreter on CPU).

Experts that get no token hold NaN weights, so reading one (a dense all-experts product,
a block assigned the wrong expert) poisons the output.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import TOLERANCE, make_moe_inputs, naive_moe, rel_err

from serve.kernels import reference


@pytest.fixture(scope="module")
def triton_ops():
    from serve.kernels import triton as ops

    return ops


def _tiny_tiles():
    from serve.kernels.triton.moe import MoeTiles

    # 16-wide tiles: the shapes below span several N tiles and K steps, with ragged ends.
    return MoeTiles(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)


# (num_tokens, num_experts, top_k, hidden, inter, unrouted experts)
CASES = {
    "decode-one-token": (1, 8, 2, 32, 24, ()),  # 6 experts get nothing
    "top1": (7, 4, 1, 32, 24, (2,)),
    "top2-unrouted": (19, 6, 2, 40, 24, (0, 4)),
    "top3-ragged": (37, 5, 3, 24, 40, ()),  # hidden and inter not multiples of the tiles
    "one-expert-takes-all": (21, 4, 1, 32, 16, (0, 1, 2)),  # two blocks of one expert
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reference_matches_per_token_oracle(case):
    num_tokens, num_experts, top_k, hidden, inter, unrouted = case
    gen = torch.Generator().manual_seed(num_tokens)
    inputs = make_moe_inputs(num_tokens, num_experts, top_k, hidden, inter, gen, unrouted=unrouted)
    out = reference.moe_experts(
        inputs.hidden, inputs.w13, inputs.w2, inputs.topk_weights, inputs.topk_ids
    )
    assert out.dtype == inputs.hidden.dtype
    assert rel_err(out, naive_moe(inputs)) < TOLERANCE[torch.float32]


def test_reference_rounds_the_weighted_rows_to_the_hidden_dtype():
    """float32 routing weights with bfloat16 experts (Mixtral's router keeps float32)."""
    gen = torch.Generator().manual_seed(5)
    inputs = make_moe_inputs(9, 4, 2, 32, 16, gen, dtype=torch.bfloat16)
    out = reference.moe_experts(
        inputs.hidden, inputs.w13, inputs.w2, inputs.topk_weights, inputs.topk_ids
    )
    assert out.dtype == torch.bfloat16
    assert rel_err(out, naive_moe(inputs)) < TOLERANCE[torch.bfloat16]


def test_no_tokens():
    w13, w2 = torch.randn(4, 32, 16), torch.randn(4, 16, 16)
    ids = torch.empty(0, 2, dtype=torch.long)
    out = reference.moe_experts(torch.empty(0, 16), w13, w2, torch.empty(0, 2), ids)
    assert out.shape == (0, 16)


def test_align_by_expert_table(device):
    """The docstring's example: experts 0, 2, 3 get pairs, expert 1 none; block_m 4."""
    from serve.kernels.triton.moe import align_by_expert

    # pairs 0..7 (top_k 1): their experts
    ids = torch.tensor([[2], [0], [2], [3], [3], [0], [3], [0]], device=device)
    sorted_pairs, block_experts = align_by_expert(ids, 4, 4)
    pad = 8
    # The grid is sized for the worst case: 8 pairs, 4 experts each padding by 3 rows at most.
    assert sorted_pairs.tolist() == [1, 5, 7, pad, 0, 2, pad, pad, 3, 4, 6] + [pad] * 9
    assert block_experts.tolist() == [0, 2, 3, 4, 4]


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_by_expert_places_every_pair_once_in_its_experts_blocks(device, block_m):
    """Many chunks of pairs, skewed routing, idle experts: each block holds one expert's
    pairs in increasing order, then padding; every pair appears exactly once."""
    from serve.kernels.triton.moe import align_by_expert

    gen = torch.Generator().manual_seed(block_m)
    num_experts, top_k = 12, 3
    probs = torch.tensor([8.0, 0, 1, 1, 0, 3, 1, 1, 0.2, 1, 1, 1])  # experts 1, 4 idle
    ids = torch.stack([torch.multinomial(probs, top_k, generator=gen) for _ in range(300)])
    sorted_pairs, block_experts = align_by_expert(ids.to(device), num_experts, block_m)
    sorted_pairs, block_experts = sorted_pairs.cpu(), block_experts.cpu()
    num_pairs = ids.numel()
    flat = ids.flatten()
    used = [e for e in range(num_experts) if (flat == e).any()]
    real_blocks = [b for b, e in enumerate(block_experts.tolist()) if e < num_experts]
    assert real_blocks == list(range(len(real_blocks)))  # real blocks first
    assert set(block_experts[len(real_blocks) :].tolist()) <= {num_experts}
    seen = []
    for b in real_blocks:
        rows = sorted_pairs[b * block_m : (b + 1) * block_m].tolist()
        pairs = [p for p in rows if p != num_pairs]
        assert rows == pairs + [num_pairs] * (block_m - len(pairs))  # padding at the end
        assert pairs == sorted(pairs) and all(flat[p] == block_experts[b] for p in pairs)
        seen += pairs
    assert sorted(seen) == list(range(num_pairs))
    assert sorted(set(block_experts[real_blocks].tolist())) == used
    assert block_experts[real_blocks].tolist() == sorted(block_experts[real_blocks].tolist())


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_triton_matches_reference(triton_ops, device, case):
    from serve.kernels.triton.moe import moe_experts

    num_tokens, num_experts, top_k, hidden, inter, unrouted = case
    gen = torch.Generator().manual_seed(num_tokens + 100)
    inputs = make_moe_inputs(
        num_tokens, num_experts, top_k, hidden, inter, gen, unrouted=unrouted, device=device
    )
    args = (inputs.hidden, inputs.w13, inputs.w2, inputs.topk_weights, inputs.topk_ids)
    out = moe_experts(*args, tiles=_tiny_tiles())
    assert out.shape == inputs.hidden.shape and out.dtype == inputs.hidden.dtype
    assert rel_err(out, reference.moe_experts(*args)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_half_precision(triton_ops, device, dtype):
    """The default tiles (the op as the layers call it), Qwen-style weights in the hidden dtype."""
    gen = torch.Generator().manual_seed(7)
    inputs = make_moe_inputs(13, 6, 2, 48, 32, gen, unrouted=(5,), dtype=dtype, device=device)
    weights = inputs.topk_weights.to(dtype)
    out = triton_ops.moe_experts(inputs.hidden, inputs.w13, inputs.w2, weights, inputs.topk_ids)
    expected = reference.moe_experts(
        inputs.hidden.float(),
        inputs.w13.float(),
        inputs.w2.float(),
        weights.float(),
        inputs.topk_ids,
    )
    assert out.dtype == dtype
    assert rel_err(out, expected) < TOLERANCE[dtype]
