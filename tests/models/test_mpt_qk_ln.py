"""MPT's `qk_ln`, greedy token for token, at one rank and at two.

transformers' MPT ignores `qk_ln` (it builds no q_ln / k_ln and does not read them), so
the oracle is transformers' MPT with MosaicML's qk_ln put back in, as llm-foundry defines
it: after Wqkv and its clamp (`clip_qkv`), a LayerNorm over the whole q projection (all
heads, d_model features) and one over the whole k projection. At two ranks each rank
holds half the heads, so the norm needs the other rank's half: this is what is checked.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from gpu_share import TWO_RANK_DEVICE
from safetensors.torch import load_file, save_file
from tiny_models import _generate, random_prompts
from torch import nn

from serve import LLM, SamplingParams

MAX_TOKENS = 10


class _WqkvWithQkLn(nn.Module):
    """Wqkv, its clamp, then q_ln and k_ln: what llm-foundry computes before attention.
    The HF attention's own clamp is switched off (it would clamp the normed q and k)."""

    def __init__(self, wqkv: nn.Linear, clip: float | None, q_ln: nn.LayerNorm, k_ln: nn.LayerNorm):
        super().__init__()
        self.wqkv, self.clip, self.q_ln, self.k_ln = wqkv, clip, q_ln, k_ln

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.wqkv(x)
        if self.clip:
            qkv = qkv.clamp(min=-self.clip, max=self.clip)
        q, k, v = qkv.chunk(3, dim=-1)
        return torch.cat([self.q_ln(q), self.k_ln(k), v], dim=-1)


@pytest.fixture(scope="module")
def qk_ln_model(tiny_model_factory, tmp_path_factory):
    """A model dir with qk_ln weights, prompts, and the oracle's greedy outputs for them."""
    base_dir = tiny_model_factory("mpt-6-heads-clip-qkv")
    model_dir = tmp_path_factory.mktemp("tiny-mpt-qk-ln")
    shutil.copytree(base_dir, model_dir, dirs_exist_ok=True)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = oracle.config
    weights = load_file(model_dir / "model.safetensors")
    torch.manual_seed(1)
    for i, block in enumerate(oracle.transformer.blocks):
        norms = []
        for name in ("q_ln", "k_ln"):  # no_bias: weights only
            norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon, bias=False)
            with torch.no_grad():
                norm.weight.copy_(1.0 + 0.1 * torch.randn(config.d_model))
            weights[f"transformer.blocks.{i}.attn.{name}.weight"] = norm.weight.detach().clone()
            norms.append(norm)
        attn = block.attn
        attn.Wqkv = _WqkvWithQkLn(attn.Wqkv, attn.clip_qkv, *norms)
        attn.clip_qkv = None
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    config_path = model_dir / "config.json"
    saved = json.loads(config_path.read_text())
    saved["attn_config"]["qk_ln"] = True
    config_path.write_text(json.dumps(saved))
    oracle.eval()
    prompts = random_prompts(512, 4, 3, 30, seed=5)
    expected = [_generate(oracle, p, MAX_TOKENS, ignore_eos=True) for p in prompts]
    plain = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    assert _generate(plain.eval(), prompts[0], MAX_TOKENS, True) != expected[0], (
        "qk_ln changes nothing"
    )
    return model_dir, prompts, expected


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_qk_ln_matches_hf_with_qk_ln(qk_ln_model, tensor_parallel_size):
    model_dir, prompts, expected = qk_ln_model
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(
        model=str(model_dir),
        tensor_parallel_size=tensor_parallel_size,
        device=TWO_RANK_DEVICE if tensor_parallel_size > 1 else "auto",
        block_size=4,
        max_num_batched_tokens=16,  # chunked prefill
        max_model_len=64,
        kv_cache_memory="8MiB",
    ) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
