"""Checkpoints of one family name their tensors more than one way: the hub's GPT-2 and
OPT files were saved from the bare body (`h.0...`, `decoder.layers...`), and old ones
carry causal-mask buffers and rotary frequencies. Every spelling loads the same model."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from serve.config import ModelConfig
from serve.models.loader import load_hf_config, load_model

MASK = torch.tril(torch.ones(1, 1, 8, 8, dtype=torch.bool))


def _load(model_dir: Path) -> torch.nn.Module:
    config = ModelConfig(dtype="float32")
    return load_model(config, model_dir, load_hf_config(model_dir), torch.device("cpu"))


def _respelled(
    model_dir: Path, out_dir: Path, rename: Callable[[str], str], extra: dict[str, torch.Tensor]
) -> Path:
    shutil.copytree(model_dir, out_dir)
    (file,) = out_dir.glob("*.safetensors")
    tensors = {rename(name): t for name, t in load_file(file).items()}
    save_file({**tensors, **extra}, file)
    return out_dir


CASES = {
    "gpt2-bare": (  # openai-community/gpt2
        "gpt2",
        lambda name: name.removeprefix("transformer."),
        {"h.0.attn.bias": MASK, "h.1.attn.masked_bias": torch.tensor(-1e4)},
    ),
    "opt-decoder": ("opt", lambda name: name.removeprefix("model."), {}),  # facebook/opt-*
    "gpt-neox-buffers": (  # Pythia
        "gpt-neox",
        lambda name: name,
        {
            "gpt_neox.layers.0.attention.bias": MASK,
            "gpt_neox.layers.0.attention.masked_bias": torch.tensor(-1e9),
            "gpt_neox.layers.0.attention.rotary_emb.inv_freq": torch.ones(2),
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_spelling_loads_the_same_model(tiny_model_factory, tmp_path, case):
    family, rename, extra = CASES[case]
    model_dir = tiny_model_factory(family)
    expected = _load(model_dir).state_dict()
    got = _load(_respelled(model_dir, tmp_path / case, rename, extra)).state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
