"""BLOOM checkpoints come two ways: BigScience's hold the bare model (`h.0.…`,
`word_embeddings.…`, no LM head), those saved by transformers prefix it with
`transformer.`. Both load to the same parameters."""

from __future__ import annotations

import torch

from serve.models.bloom import BloomForCausalLM
from serve.models.loader import iterate_checkpoint, load_hf_config
from serve.models.registry import get_arch_config
from serve.models.weights import load_checkpoint


def test_bigscience_names_load_like_transformers_names(tiny_model_factory):
    model_dir = tiny_model_factory("bloom")
    arch = get_arch_config(load_hf_config(model_dir))

    def load(bare: bool) -> dict[str, torch.Tensor]:
        model = BloomForCausalLM(arch)
        weights = (
            (name.removeprefix("transformer.") if bare else name, tensor)
            for name, tensor in iterate_checkpoint(model_dir)
            if not (bare and name.startswith("lm_head."))
        )
        load_checkpoint(model, weights, model.weight_spec)
        return model.state_dict()

    prefixed, bare = load(bare=False), load(bare=True)
    assert prefixed.keys() == bare.keys()
    assert all(torch.equal(prefixed[name], bare[name]) for name in prefixed)
