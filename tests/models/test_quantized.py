"""Quantized checkpoints (GPTQ, AWQ, FP8) served as they are.

The oracle: transformers on the checkpoint's dequantized float twin (quantized_models.py
packs the tiny Llama as each quantizer writes it), greedy token for token in float32, with
prompts chunked and batched together; for block-scaled FP8, transformers reading the FP8
checkpoint itself.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from gpu_share import TWO_RANK_DEVICE
from quantized_models import (
    AUTOAWQ_PACK_ORDER,
    ENGINE,
    MAX_TOKENS,
    fp8_rows_twin,
    quantize_checkpoint,
)
from tiny_models import hf_greedy, random_prompts

from serve import LLM, SamplingParams
from serve.config import EngineConfig
from serve.models.loader import load_hf_config, load_model
from serve.models.quantization import checkpoint_format
from serve.models.quantization.awq import unpack_outputs
from serve.models.quantization.base import unpack_int32

PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

VARIANTS = {
    "gptq-4bit": ("gptq", {}),
    "gptq-8bit-sym": ("gptq", {"bits": 8, "sym": True}),
    "gptq-act-order": ("gptq", {"act_order": True}),
    "gptq-v2": ("gptq", {"gptq_v2": True}),
    "awq": ("awq", {}),
    "fp8-blocks": ("fp8", {"block": (16, 16)}),
    "fp8-per-tensor": ("fp8", {"block": None}),
}


@pytest.fixture(scope="module")
def quantized(tiny_llama, tmp_path_factory):
    """variant -> (quantized checkpoint, dequantized twin), made once each."""
    made: dict[str, tuple] = {}

    def make(variant: str):
        if variant not in made:
            method, options = VARIANTS[variant]
            out = tmp_path_factory.mktemp(variant)
            made[variant] = quantize_checkpoint(tiny_llama, out, method, **options)
        return made[variant]

    return make


def _prompts() -> list[list[int]]:
    return random_prompts(512, 4, 3, 30, seed=3)


def _serve_greedy(model_dir, prompts, **engine) -> list[list[int]]:
    with LLM(model=str(model_dir), **{**ENGINE, **engine}) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_matches_transformers_on_the_dequantized_weights(quantized, tiny_llama, variant):
    checkpoint, twin = quantized(variant)
    prompts = _prompts()
    got = _serve_greedy(checkpoint, prompts)
    expected = [hf_greedy(twin, p, MAX_TOKENS, ignore_eos=True) for p in prompts]
    assert got == expected
    if variant.startswith(("gptq-4bit", "awq")):  # the rounding shows: not the float model
        unquantized = [hf_greedy(tiny_llama, p, MAX_TOKENS, ignore_eos=True) for p in prompts]
        assert got != unquantized


def test_block_fp8_is_what_transformers_reads_from_the_checkpoint(quantized):
    """transformers dequantizes a block-scaled FP8 checkpoint on a CPU; serve keeps it FP8
    and gives the same tokens."""
    checkpoint, _ = quantized("fp8-blocks")
    prompts = _prompts()
    assert _serve_greedy(checkpoint, prompts) == [
        hf_greedy(checkpoint, p, MAX_TOKENS, ignore_eos=True) for p in prompts
    ]


@pytest.mark.parametrize("variant", ["gptq-act-order", "awq"])
def test_two_ranks_read_their_slices(quantized, variant):
    """Each rank reads its rows of q/k/v and gate/up and its inputs of o/down (their groups,
    or all of act order's), and the tokens stay the twin's."""
    checkpoint, twin = quantized(variant)
    prompts = _prompts()[:2]
    with LLM(
        model=str(checkpoint), tensor_parallel_size=2, device=TWO_RANK_DEVICE, **ENGINE
    ) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    got = [out.outputs[0].token_ids for out in outputs]
    assert got == [hf_greedy(twin, p, MAX_TOKENS, ignore_eos=True) for p in prompts]


def test_fp8_over_a_float_checkpoint_rounds_each_row_as_it_loads(tiny_llama, tmp_path):
    """`--quantization fp8` on a float checkpoint: the linears are FP8 in memory, the
    head is not, and the tokens are transformers' on the weights rounded by rows."""
    twin = fp8_rows_twin(tiny_llama, tmp_path / "twin")
    model = _load(tiny_llama, quantization="fp8")
    assert model.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight.dtype == torch.float32
    prompts = _prompts()
    got = _serve_greedy(tiny_llama, prompts, quantization="fp8")
    assert got == [hf_greedy(twin, p, MAX_TOKENS, ignore_eos=True) for p in prompts]


def test_a_vision_language_models_quantized_language_model(tiny_llava, tmp_path):
    """AWQ's and GPTQ's LLaVA and Qwen2.5-VL checkpoints quantize the language model and
    keep the tower float: serve packs the language model's layers and runs the tower as
    before, greedy equal to transformers' on the dequantized twin, with images."""
    from image_fixtures import run_in_steps
    from tiny_models import build_llava_tokenizer, hf_vl_greedy, random_image

    from serve.engine.multimodal import MultiModalProcessor

    checkpoint, twin = quantize_checkpoint(
        tiny_llava, tmp_path, "gptq", act_order=True, only="language_model."
    )
    tokenizer = build_llava_tokenizer()
    processor = MultiModalProcessor.from_model(checkpoint, load_hf_config(checkpoint), tokenizer)
    cases = [("hello <image> what is this?", [random_image(1)]), ("no image here", [])]
    prompts = [processor.process(tokenizer(text)["input_ids"], images) for text, images in cases]
    with LLM(model=str(checkpoint), **ENGINE | {"max_model_len": 128}) as llm:
        got = [list(o.outputs[0].token_ids) for o in run_in_steps(llm, prompts, PARAMS)]
    expected = [
        hf_vl_greedy(twin, token_ids, images, MAX_TOKENS)
        for (token_ids, _), (_, images) in zip(prompts, cases)
    ]
    assert got == expected


def test_a_quantized_vision_tower_is_refused_naming_it(tiny_llava, tmp_path):
    checkpoint, _ = quantize_checkpoint(tiny_llava, tmp_path, "awq", only="vision_tower.")
    with pytest.raises(ValueError, match="holds .*vision_tower.* quantized .* with the vision"):
        _load(checkpoint)


MOE_VARIANTS = {
    "qwen3-moe-gptq-act-order": ("qwen3-moe", "gptq", {"act_order": True}),
    "qwen2-moe-awq": ("qwen2-moe", "awq", {}),  # with its shared expert
    "mixtral-fp8-blocks": ("mixtral", "fp8", {"block": (16, 16)}),
}


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_mixture_of_experts_quantized_expert_by_expert(tiny_model_factory, tmp_path, variant):
    """Each expert's gate, up and down are packed like any linear's (GPTQ's, AWQ's and FP8
    releases of Qwen-MoE and Mixtral quantize them per expert), routed tokens run through
    their experts' packed layers, and the tokens are the dequantized twin's."""
    family, method, options = MOE_VARIANTS[variant]
    checkpoint, twin = quantize_checkpoint(tiny_model_factory(family), tmp_path, method, **options)
    prompts = _prompts()
    two = {"tensor_parallel_size": 2, "device": TWO_RANK_DEVICE}
    tp = two if variant.startswith("mixtral") else {}
    with LLM(model=str(checkpoint), **ENGINE, **tp) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    got = [out.outputs[0].token_ids for out in outputs]
    assert got == [hf_greedy(twin, p, MAX_TOKENS, ignore_eos=True) for p in prompts]


def test_lora_adapters_over_a_quantized_model(quantized, tmp_path):
    """QLoRA's serving: an adapter trained on a quantized base adds its update to the
    packed layer's output; the tokens are the dequantized twin's with the adapter merged."""
    from tiny_models import make_tiny_lora, merge_tiny_lora

    from serve.lora_request import LoRARequest

    checkpoint, twin = quantized("awq")
    folder = make_tiny_lora(
        twin, tmp_path / "adapter", targets=("q_proj", "gate_proj", "down_proj")
    )
    oracle = merge_tiny_lora(twin, folder, tmp_path / "merged")
    prompts = _prompts()[:2]
    with LLM(model=str(checkpoint), enable_lora=True, **ENGINE) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            PARAMS,
            lora_request=[LoRARequest("a", 1, str(folder)), None],
        )
    got = [out.outputs[0].token_ids for out in outputs]
    assert got[0] == hf_greedy(oracle, prompts[0], MAX_TOKENS, ignore_eos=True)
    assert got[1] == hf_greedy(twin, prompts[1], MAX_TOKENS, ignore_eos=True)
    assert got[0] != hf_greedy(twin, prompts[0], MAX_TOKENS, ignore_eos=True)


def _load(model_dir, **settings):
    config = EngineConfig.create(str(model_dir), **settings).model
    return load_model(config, model_dir, load_hf_config(model_dir), torch.device("cpu"))


def test_packed_weights_stay_packed(quantized, tiny_llama):
    """A 4-bit layer holds a quarter byte a weight plus its groups' scales: what the format
    saves is saved in memory too, and the unquantized LM head and norms stay float."""
    float_model = _load(tiny_llama)
    model = _load(quantized("gptq-4bit")[0])
    layer = model.model.layers[0].mlp.gate_up_proj
    assert not hasattr(layer, "weight") and layer.qweight.dtype == torch.uint8
    assert layer.qweight.nbytes == float_model.model.layers[0].mlp.gate_up_proj.weight.numel() // 2
    assert model.lm_head.weight.dtype == torch.float32
    linears = [n for n, _ in model.named_modules() if n.endswith(("_proj", "qkv_proj"))]
    assert all(model.get_submodule(n).packed_weight is not None for n in linears)


# our decoder linear: the checkpoint modules whose rows it stacks
DECODER_LINEARS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def test_act_order_inputs_are_sorted_by_group_at_load(quantized):
    """At one rank every act-order layer holds whole groups of 16: its inputs are stored
    sorted by group (input_perm, the checkpoint's g_idx in order along it), no g_idx left
    for the kernels to look up, and dequantized in the checkpoint's order it is the twin's
    weight exactly."""
    from safetensors.torch import load_file

    from serve.kernels.reference import dequantize

    checkpoint, twin = quantized("gptq-act-order")
    model = _load(checkpoint)
    packed = load_file(str(checkpoint / "model.safetensors"))
    floats = load_file(str(twin / "model.safetensors"))
    for i, block in enumerate(model.model.layers):
        for ours, theirs in DECODER_LINEARS.items():
            layer = block.get_submodule(ours)
            weight = layer.packed_weight
            assert weight.g_idx is None
            assert weight.codes is layer.qweight  # sorted in place: one copy in memory
            g_idx = packed[f"model.layers.{i}.{theirs[0]}.g_idx"].long()
            in_order = torch.arange(weight.in_features) // 16
            assert torch.equal(g_idx[weight.input_perm], in_order)
            expected = torch.cat([floats[f"model.layers.{i}.{m}.weight"] for m in theirs])
            assert torch.equal(dequantize(weight, torch.float32), expected)


def row_parallel_act_order_on_rank(checkpoint, twin) -> int:
    """At this rank of two, o_proj's and down_proj's inputs are half the checkpoint's, a
    random half of each group: uneven groups, which keep the g_idx lookup, and the packed
    weight is the twin's columns of this rank. The layers checked."""
    from safetensors.torch import load_file

    from serve.distributed.parallel_state import get_tp_group
    from serve.kernels.reference import dequantize

    model = _load(checkpoint)
    floats = load_file(str(twin / "model.safetensors"))
    rank, checked = get_tp_group().rank, 0
    for i, block in enumerate(model.model.layers):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            weight = block.get_submodule(name).packed_weight
            assert weight.g_idx is not None and weight.input_perm is None
            expected = floats[f"model.layers.{i}.{name}.weight"].chunk(2, dim=1)[rank]
            assert torch.equal(dequantize(weight, torch.float32), expected)
            checked += 1
    return checked


def test_act_order_row_parallel_slices_keep_their_lookup(quantized, tp2_ranks):
    checkpoint, twin = quantized("gptq-act-order")
    num_layers = len(_load(checkpoint).model.layers)
    assert tp2_ranks.run(row_parallel_act_order_on_rank, checkpoint, twin) == [2 * num_layers] * 2


def test_unpacking_reads_the_fields_lowest_first():
    word = sum(v << (4 * k) for k, v in enumerate([1, 2, 3, 4, 5, 6, 7, 15]))
    words = torch.tensor([[word - 2**32 if word >= 2**31 else word]], dtype=torch.int32)
    assert unpack_int32(words, 4, dim=1).tolist() == [[1, 2, 3, 4, 5, 6, 7, 15]]
    assert unpack_int32(words, 8, dim=0).flatten().tolist() == [0x21, 0x43, 0x65, 0xF7]


def test_awq_words_hold_outputs_in_autoawqs_order():
    """AutoAWQ packs output 8j + ORDER[k] into field k; reading puts them back in order."""
    outputs = [10, 11, 12, 13, 14, 15, 0, 9]  # values of outputs 0..7, each < 16
    word = sum(outputs[source] << (4 * field) for field, source in enumerate(AUTOAWQ_PACK_ORDER))
    words = torch.tensor([[word - 2**32 if word >= 2**31 else word]], dtype=torch.int32)
    assert unpack_outputs(words).tolist() == [outputs]


def _with_quantization_config(model_dir, tmp_path, config):
    target = tmp_path / "checkpoint"
    shutil.copytree(model_dir, target)
    data = json.loads((target / "config.json").read_text())
    data["quantization_config"] = config
    (target / "config.json").write_text(json.dumps(data))
    return target


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "bitsandbytes"}, r"\(bitsandbytes\); serve reads gptq, awq, fp8"),
        ({"quant_method": "gptq", "bits": 3}, "GPTQ with 3 bits: serve runs 4- and 8-bit"),
        ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "'marlin': serve reads 'gptq'"),
        ({"quant_method": "awq", "version": "gemv"}, "version 'gemv'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "serve reads float8 e4m3 weights"),
    ],
)
def test_formats_serve_does_not_read_are_refused_by_name(tiny_llama, tmp_path, config, message):
    model_dir = _with_quantization_config(tiny_llama, tmp_path, config)
    with pytest.raises(ValueError, match=message):
        checkpoint_format(load_hf_config(model_dir))


def test_a_config_that_says_quantized_over_float_tensors_is_refused(tiny_llama, tmp_path):
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    model_dir = _with_quantization_config(tiny_llama, tmp_path, config)
    with pytest.raises(
        ValueError, match=r"but no tensor of it is \(none ends in .weight_scale_inv"
    ):
        _load(model_dir)


def test_the_flag_must_name_the_checkpoints_method(quantized, tiny_llama):
    gptq = load_hf_config(quantized("gptq-4bit")[0])
    assert checkpoint_format(gptq, "gptq_marlin").describe() == "GPTQ 4-bit, groups of 16"
    with pytest.raises(ValueError, match="quantized with 'gptq'; leave the flag out or pass gptq"):
        checkpoint_format(gptq, "awq")
    with pytest.raises(ValueError, match="the checkpoint is not quantized .* to fp8 only"):
        checkpoint_format(load_hf_config(tiny_llama), "awq")
    assert checkpoint_format(load_hf_config(tiny_llama), "fp8") is None  # rounded as it loads


def test_a_quantized_lm_head_is_refused_naming_it(quantized, tmp_path):
    """GPTQ's `lm_head: true` quantizes the head, which serve's vocabulary-parallel head
    cannot hold packed: refused at load, naming the module."""
    from safetensors.torch import load_file, save_file

    checkpoint = tmp_path / "gptq"
    shutil.copytree(quantized("gptq-4bit")[0], checkpoint)
    state = load_file(str(checkpoint / "model.safetensors"))
    layer = {k.split(".")[-1]: v for k, v in state.items() if ".0.mlp.up_proj." in k}
    state.update({f"lm_head.{name}": t.clone() for name, t in layer.items()})
    save_file(state, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="holds lm_head quantized .* a ParallelLMHead"):
        _load(checkpoint)


def test_a_rank_split_off_the_groups_is_refused(quantized):
    """Groups of 48 inputs cannot split 64 inputs over two ranks on whole groups."""
    from serve.models.layers.linear import LinearSharding, OutputShard
    from serve.models.quantization.base import groups_for

    whole = OutputShard(None, 64, 0, 64)
    sharding = LinearSharding({None: (0, whole)}, 64, 32, 32)
    with pytest.raises(ValueError, match="does not fall on whole units of 48"):
        groups_for(sharding, 48, keep_all=False)
    assert groups_for(sharding, 16, keep_all=False).first == 2
    assert groups_for(sharding, 48, keep_all=True).count == 2  # act order keeps all
