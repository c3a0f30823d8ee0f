"""The sparse MoE block (layers/fused_moe.py) against transformers' own blocks, at one rank
and at two (gloo CPU ranks), with the weights fed through the families' WeightSpecs from
per-expert checkpoint names; routing against transformers' routers, bit for bit.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from serve.models.layers.fused_moe import SparseMoeBlock, route
from serve.models.llama import LlamaMLP
from serve.models.moe import MixtralForCausalLM, QwenMoeForCausalLM
from serve.models.partition import check_tensor_parallel
from serve.models.registry import get_arch_config
from serve.models.weights import load_checkpoint

HIDDEN, NUM_TOKENS = 64, 11

# block kind -> (model_type, config fields, HF block class, per-expert checkpoint names).
# The ranks never import transformers (slow on two cores): they get the checkpoint.
BLOCKS = {
    "mixtral": (
        "mixtral",
        {"num_local_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 48},
        "MixtralSparseMoeBlock",
        ("w1", "w3", "w2"),
    ),
    "qwen2-moe": (
        "qwen2_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 40,
            "norm_topk_prob": False,
        },
        "Qwen2MoeSparseMoeBlock",
        ("gate_proj", "up_proj", "down_proj"),
    ),
    "qwen2-moe-normalised": (
        "qwen2_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 40,
            "norm_topk_prob": True,
        },
        "Qwen2MoeSparseMoeBlock",
        ("gate_proj", "up_proj", "down_proj"),
    ),
    "qwen3-moe": (
        "qwen3_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
        "Qwen3MoeSparseMoeBlock",
        ("gate_proj", "up_proj", "down_proj"),
    ),
}


def _hf_config(kind: str):
    import transformers

    model_type, fields, _, _ = BLOCKS[kind]
    return transformers.AutoConfig.for_model(model_type, hidden_size=HIDDEN, **fields)


def _hf_block(kind: str, seed: int) -> torch.nn.Module:
    model_type, _, class_name, _ = BLOCKS[kind]
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    torch.manual_seed(seed)
    block = getattr(modeling, class_name)(_hf_config(kind)).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.2)
    return block


def _checkpoint(kind: str, block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The block's weights under the per-expert names checkpoints use."""
    gate_name, up_name, down_name = BLOCKS[kind][3]
    state = dict(block.state_dict())
    gate_up, down = state.pop("experts.gate_up_proj"), state.pop("experts.down_proj")
    inter = down.shape[2]
    for e in range(gate_up.shape[0]):
        state[f"experts.{e}.{gate_name}.weight"] = gate_up[e, :inter]
        state[f"experts.{e}.{up_name}.weight"] = gate_up[e, inter:]
        state[f"experts.{e}.{down_name}.weight"] = down[e]
    return state


def block_output_on_rank(
    kind: str, checkpoint: dict[str, torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """Our block, built as the families build theirs (serve/models/moe.py), loaded from
    the whole checkpoint through the family's WeightSpec (each rank keeps its slice)."""
    fields = BLOCKS[kind][1]
    if kind == "mixtral":
        block = SparseMoeBlock(
            HIDDEN, fields["num_local_experts"], fields["num_experts_per_tok"],
            fields["intermediate_size"], renormalize=True, float32_weights=True,
        )  # fmt: skip
        spec = MixtralForCausalLM.weight_spec
    else:
        shared = None
        if "shared_expert_intermediate_size" in fields:
            width = fields["shared_expert_intermediate_size"]
            shared = LlamaMLP(HIDDEN, width, "silu", bias=False, reduce_results=False)
        block = SparseMoeBlock(
            HIDDEN, fields["num_experts"], fields["num_experts_per_tok"],
            fields["moe_intermediate_size"], renormalize=fields["norm_topk_prob"],
            shared_expert=shared,
        )  # fmt: skip
        spec = QwenMoeForCausalLM.weight_spec
    load_checkpoint(block, checkpoint.items(), spec)
    with torch.no_grad():
        return block(x)


def _case(kind: str) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(checkpoint, tokens, transformers' output)."""
    hf_block = _hf_block(kind, 0)
    x = torch.randn(NUM_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_block(x[None])[0]
    return _checkpoint(kind, hf_block), x, expected


@pytest.mark.parametrize("kind", BLOCKS)
def test_block_matches_transformers(kind):
    checkpoint, x, expected = _case(kind)
    out = block_output_on_rank(kind, checkpoint, x)
    assert (out - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("kind", ["mixtral", "qwen2-moe"])
def test_block_at_two_ranks_matches_transformers(tp2_ranks, kind):
    """Each rank holds half of every expert's (and the shared expert's) width."""
    checkpoint, x, expected = _case(kind)
    for out in tp2_ranks.run(block_output_on_rank, kind, checkpoint, x):
        assert (out - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen2-moe", "qwen2-moe-normalised"])
def test_route_is_transformers_router_bit_for_bit(kind, dtype):
    """Weights, experts and the weights' dtype: Mixtral's stay float32, Qwen's are cast."""
    router = _hf_block(kind, 2).gate.to(dtype)
    x = torch.randn(50, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        _, expected_weights, expected_ids = router(x)
        weights, ids = route(
            F.linear(x, router.weight),
            router.top_k,
            renormalize=getattr(router, "norm_topk_prob", True),
            float32_weights=kind == "mixtral",
        )
    assert torch.equal(ids, expected_ids)
    assert weights.dtype == expected_weights.dtype
    assert torch.equal(weights, expected_weights)


def test_split_sizes_name_the_expert_widths():
    hf = _hf_config("qwen2-moe")
    hf.architectures = ["Qwen2MoeForCausalLM"]
    hf.num_hidden_layers, hf.mlp_only_layers = 2, [0]
    sizes = get_arch_config(hf).split_sizes
    assert sizes == {
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 40,
        "intermediate_size": hf.intermediate_size,  # layer 0 is dense
    }
    with pytest.raises(ValueError, match="must divide shared_expert_intermediate_size 40"):
        check_tensor_parallel(get_arch_config(hf), 16)
    hf.mlp_only_layers = []  # every layer sparse: the dense width is never used
    assert "intermediate_size" not in get_arch_config(hf).split_sizes
