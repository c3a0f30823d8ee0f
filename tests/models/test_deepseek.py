"""DeepSeek-V2/V3 beyond the families' greedy runs (test_families.py): the router against
transformers' own on fresh inputs, the latent cache's size, DeepSeek-V3's FP8 release
format and its multi-token-prediction layer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from gpu_share import TWO_RANK_DEVICE
from quantized_models import ENGINE, MAX_TOKENS, quantize_checkpoint
from safetensors.torch import load_file, save_file
from tiny_models import hf_greedy, make_tiny_config, random_prompts
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from serve import LLM, SamplingParams
from serve.models.deepseek import DeepseekRouter

ROUTERS = {
    # family key, config overrides, transformers' router, sigmoid scores
    "v2-greedy": ("deepseek-v2", {"topk_method": "greedy"}, DeepseekV2TopkRouter, False),
    "v2-group-limited": ("deepseek-v2", {}, DeepseekV2TopkRouter, False),
    "v3-noaux-tc": ("deepseek-v3", {}, DeepseekV3TopkRouter, True),
    "v3-one-group": ("deepseek-v3", {"n_group": 1, "topk_group": 1}, DeepseekV3TopkRouter, True),
    "v3-unnormalised": ("deepseek-v3", {"norm_topk_prob": False}, DeepseekV3TopkRouter, True),
}


@pytest.mark.parametrize("case", ROUTERS)
def test_router_picks_transformers_experts_with_its_weights(case):
    family, overrides, hf_router_class, sigmoid = ROUTERS[case]
    config = make_tiny_config(family, n_routed_experts=16, **overrides)
    torch.manual_seed(0)
    hf_router = hf_router_class(config)
    ours = DeepseekRouter(config, config.hidden_size, sigmoid)
    with torch.no_grad():
        hf_router.weight.normal_(0.0, 0.2)
        ours.weight.copy_(hf_router.weight)
        if sigmoid:
            hf_router.e_score_correction_bias.normal_(0.0, 0.2)
            ours.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)
    hidden = torch.randn(64, config.hidden_size)
    _, hf_weights, hf_ids = hf_router(hidden)
    weights, ids = ours(hidden)
    # Both choose in topk's unsorted order: compare each token's experts by id.
    hf_ids, hf_order = hf_ids.sort(dim=-1)
    ids, order = ids.sort(dim=-1)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))
    assert weights.dtype == torch.float32
    if ours.group_score is not None and ours.num_groups > 1:
        groups = ids // (16 // ours.num_groups)  # each token's experts lie in topk_group groups
        assert all(len(set(row.tolist())) <= ours.topk_groups for row in groups)


def test_the_latent_cache_holds_one_tensor_a_layer(tiny_model_factory):
    """Each token caches [c | k_pe] (kv_lora_rank + qk_rope_head_dim = 40 numbers) once
    for all its heads, keys and values alike: a block costs 2 layers x 4 tokens x 40
    float32, where the expanded keys and values would cost 4 heads x (24 + 24) x 2."""
    model_dir = tiny_model_factory("deepseek-v3")
    with LLM(model=str(model_dir), block_size=4, kv_cache_memory="1MiB") as llm:
        runner = llm.engine.executor.worker.model_runner
        kv = runner.kv
        assert (kv.shared_kv, kv.num_kv_heads, kv.head_dim) == (True, 1, 40)
        assert runner.bytes_per_block == 2 * 4 * 40 * 4
        assert llm.engine.executor.num_blocks == (1 << 20) // (2 * 4 * 40 * 4)
        for key_cache, value_cache in runner.cache_engine.kv_caches:
            assert value_cache is key_cache
            assert tuple(key_cache.shape[1:]) == (4, 1, 40)


@pytest.mark.parametrize("tp", [1, 2])
def test_block_fp8_deepseek_v3_matches_its_dequantized_twin(tiny_model_factory, tmp_path, tp):
    """DeepSeek-V3's own release format: 128x128-block FP8 weights (16x16 here) for every
    attention projection and expert, router and norms float. kv_b_proj is read back to
    float for the absorbed query and output."""
    checkpoint, twin = quantize_checkpoint(
        tiny_model_factory("deepseek-v3"), tmp_path, "fp8", block=(16, 16)
    )
    prompts = random_prompts(512, 4, 3, 30, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    device = TWO_RANK_DEVICE if tp > 1 else "auto"
    with LLM(model=str(checkpoint), tensor_parallel_size=tp, device=device, **ENGINE) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [out.outputs[0].token_ids for out in outputs]
    assert got == [hf_greedy(twin, p, MAX_TOKENS, ignore_eos=True) for p in prompts]


def test_the_multi_token_prediction_layer_is_skipped(tiny_model_factory, tmp_path):
    """DeepSeek-V3's releases carry `num_nextn_predict_layers` extra layers after the last
    one (its MTP module: a decoder layer plus eh_proj, enorm, hnorm). They load as nothing
    and change nothing; a tensor of any other unknown layer still fails the load."""
    model_dir = tiny_model_factory("deepseek-v3")
    with_mtp = tmp_path / "with-mtp"
    shutil.copytree(model_dir, with_mtp)
    state = load_file(str(model_dir / "model.safetensors"))
    hidden = state["model.norm.weight"].shape[0]
    extra = {
        k.replace("layers.1.", "layers.2."): v.clone() for k, v in state.items() if "layers.1." in k
    }
    extra["model.layers.2.eh_proj.weight"] = torch.randn(hidden, 2 * hidden)
    extra["model.layers.2.enorm.weight"] = torch.ones(hidden)
    save_file({**state, **extra}, str(with_mtp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((with_mtp / "config.json").read_text())
    (with_mtp / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))

    prompts = random_prompts(512, 3, 3, 20, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model=str(with_mtp), **ENGINE) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [out.outputs[0].token_ids for out in outputs]
    assert got == [hf_greedy(model_dir, p, MAX_TOKENS, ignore_eos=True) for p in prompts]

    # With none declared (transformers' config says 1 where config.json is silent), layer
    # 2's tensors have no place.
    (with_mtp / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="layers.2"):
        LLM(model=str(with_mtp), **ENGINE)
