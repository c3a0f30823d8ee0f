"""GPT-OSS in OpenAI's release format: the experts in MXFP4, kept packed, token for token
what transformers serves from the same checkpoint (it dequantizes the experts on the CPU).
The float model's runs are test_families.py's (native) and test_transformers_backend.py's."""

from __future__ import annotations

import pytest
import torch
from gpu_share import TWO_RANK_DEVICE
from quantized_models import ENGINE, MAX_TOKENS, mxfp4_gpt_oss
from tiny_models import hf_greedy, random_prompts

from serve import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tiny_model_factory, tmp_path_factory):
    # Experts 64 wide: each of two ranks holds 32, one MXFP4 group.
    model_dir = tiny_model_factory("gpt-oss", intermediate_size=64)
    checkpoint, _ = mxfp4_gpt_oss(model_dir, tmp_path_factory.mktemp("gpt-oss-mxfp4"))
    return checkpoint


@pytest.mark.parametrize("tp", [1, 2])
def test_mxfp4_experts_match_transformers_on_the_same_checkpoint(mxfp4_checkpoint, tp):
    prompts = random_prompts(512, 4, 3, 30, seed=3)
    device = TWO_RANK_DEVICE if tp > 1 else "auto"
    with LLM(model=str(mxfp4_checkpoint), tensor_parallel_size=tp, device=device, **ENGINE) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    got = [out.outputs[0].token_ids for out in outputs]
    assert got == [hf_greedy(mxfp4_checkpoint, p, MAX_TOKENS, ignore_eos=True) for p in prompts]


def test_mxfp4_experts_stay_packed(mxfp4_checkpoint):
    """Half a byte a weight plus a float32 scale per 32: the float projections are gone."""
    with LLM(model=str(mxfp4_checkpoint), **ENGINE) as llm:
        experts = llm.engine.executor.worker.model_runner.model.model.layers[0].mlp.experts
        params = dict(experts.named_parameters())
        assert "gate_up_proj" not in params and "down_proj" not in params
        assert params["gate_up_proj_blocks"].dtype == torch.uint8
        assert tuple(params["gate_up_proj_blocks"].shape) == (4, 128, 32)  # 2 x 64 rows, 64 / 2
        assert tuple(params["down_proj_scales"].shape) == (4, 64, 2)  # 64 / 32 groups
        # Scales are powers of two, read exactly from their E8M0 bytes.
        scales = params["gate_up_proj_scales"]
        assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)


def test_an_mxfp4_split_inside_the_scale_groups(tiny_model_factory, tmp_path):
    """Experts 96 wide over two ranks: each holds 48 inputs of down_proj, rank 1's starting
    halfway through a group of 32 (as gpt-oss-120b's 2,880 over 4 or 8 ranks do); each
    keeps the groups its inputs touch and looks each input's group up."""
    checkpoint, _ = mxfp4_gpt_oss(tiny_model_factory("gpt-oss", intermediate_size=96), tmp_path)
    prompts = random_prompts(512, 3, 3, 30, seed=4)
    with LLM(
        model=str(checkpoint), tensor_parallel_size=2, device=TWO_RANK_DEVICE, **ENGINE
    ) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    got = [out.outputs[0].token_ids for out in outputs]
    assert got == [hf_greedy(checkpoint, p, MAX_TOKENS, ignore_eos=True) for p in prompts]
