"""Rope variants' frequencies against transformers' own (ROPE_INIT_FUNCTIONS), bit for bit;
the greedy tests in tests/engine run whole models with them."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from serve.models.layers.rotary import RotaryEmbedding, rope_parameters, yarn_inv_freq


@pytest.mark.parametrize(
    "scaling",
    [
        {"factor": 4.0},  # the original context defaults to max_position_embeddings
        {"factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2},
        # DeepSeek's pair of mscales, and an attention factor given outright
        {
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
        {
            "factor": 2.0,
            "original_max_position_embeddings": 48,
            "attention_factor": 1.3,
            "truncate": False,
        },
    ],
)
def test_yarn_equals_transformers(scaling):
    config = make_tiny_config(
        "llama", rope_scaling={"rope_type": "yarn", **scaling}, max_position_embeddings=128
    )
    want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    params = rope_parameters(config)
    inv_freq, factor = yarn_inv_freq(2 * want_inv_freq.shape[0], params)
    assert torch.equal(inv_freq, want_inv_freq)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    # cos and sin both carry the factor, as transformers' rotary embedding multiplies them
    rope = RotaryEmbedding(2 * want_inv_freq.shape[0], 128, params)
    positions = torch.arange(128, dtype=torch.float32)
    angles = torch.outer(positions, want_inv_freq)
    want = torch.cat((angles.cos() * want_factor, angles.sin() * want_factor), dim=-1)
    assert torch.equal(rope.cos_sin_cache, want)


def test_an_unknown_rope_type_points_at_the_transformers_backend():
    params = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="--model-impl transformers"):
        RotaryEmbedding(16, 64, params)
