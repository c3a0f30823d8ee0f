"""ALiBi slopes bit for bit as transformers builds them, for every head count a checkpoint
might have: BLOOM's series, Falcon's (BLOOM's rounded to bfloat16) and MPT's own."""

from __future__ import annotations

import torch
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
from transformers.models.falcon.modeling_falcon import build_alibi_tensor
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

from serve.models.falcon import falcon_alibi_slopes
from serve.models.layers.attention import alibi_slopes
from serve.models.mpt import mpt_alibi_slopes

HEAD_COUNTS = [*range(1, 72), 96, 112, 128]


def test_bloom_slopes():
    for n in HEAD_COUNTS:
        assert torch.equal(alibi_slopes(n), _get_alibi_slopes(n, torch.device("cpu"))), n


def test_falcon_slopes_are_transformers_bfloat16_slopes_times_the_scale():
    ones = torch.ones(1, 2, dtype=torch.long)
    for n in HEAD_COUNTS:
        # transformers' bias at key position 1 is its (bfloat16) slope; the scale of
        # head_dim 16, 1/4, is exact, so the slope comes back exactly.
        bias = build_alibi_tensor(ones, n, torch.float32)  # [n, 1, 2]
        assert torch.equal(falcon_alibi_slopes(n, 16) * 4, bias[:, 0, 1]), n


def test_mpt_slopes():
    for alibi_bias_max in (8, 16):
        for n in HEAD_COUNTS:
            # transformers' bias of the key one before the last is minus the slope.
            bias = build_mpt_alibi_tensor(n, 2, alibi_bias_max)  # [n, 1, 2]
            assert torch.equal(mpt_alibi_slopes(n, alibi_bias_max), -bias[:, 0, 0]), n
