"""compressed-tensors checkpoints (llm-compressor's format) served as they are, weight-only.

The oracle: the compressed-tensors package itself writes each checkpoint of the tiny Llama
as llm-compressor saves one (`apply_quantization_config`, min-max scales from its
`calculate_qparams`, `ModelCompressor.compress_model`, `save_pretrained`, `update_config`),
and transformers reads it back with the package decompressing it
(`CompressedTensorsConfig(dequantize=True)`: a plain float model whose weights the package
dequantized). That is the model serve runs: transformers' other route keeps the modules'
quantization hooks, which also fake-quantize the activations of the W8A8 schemes (FP8
dynamic, INT8), and serve runs those weight-only, as vLLM does on GPUs without the matmul.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from gpu_share import TWO_RANK_DEVICE
from quantized_models import ENGINE, MAX_TOKENS
from safetensors.torch import load_file, save_file
from tiny_models import _generate, hf_greedy, random_prompts

from serve import LLM, SamplingParams
from serve.config import EngineConfig
from serve.kernels.reference import dequantize
from serve.models.loader import load_hf_config, load_model
from serve.models.quantization import checkpoint_format
from serve.models.quantization.base import QuantFormat

PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

INT4 = {"num_bits": 4, "type": "int"}
INT4_GROUP = {**INT4, "strategy": "group", "group_size": 16}
INT8_CHANNEL = {"num_bits": 8, "type": "int", "strategy": "channel"}
FP8_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel"}
FP8_TOKENS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
INT8_TOKENS = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
ASYM = {"symmetric": False}
# scheme -> (weights, input activations): RedHatAI's -quantized.w4a16 (and its asymmetric
# variant), -quantized.w8a16, -FP8-dynamic and -quantized.w8a8, then the rarer layouts.
SCHEMES = {
    "w4a16-group": (INT4_GROUP, None),
    "w4a16-asym": ({**INT4_GROUP, **ASYM}, None),
    "w8a16-channel": (INT8_CHANNEL, None),
    "fp8-channel": (FP8_CHANNEL, FP8_TOKENS),
    "int8-w8a8": (INT8_CHANNEL, INT8_TOKENS),
    "w4a16-channel-asym": ({**INT4, "strategy": "channel", **ASYM}, None),
    "w4a16-tensor-asym": ({**INT4, **ASYM}, None),  # its one zero point is not packed
    "w8a16-group-asym": ({**INT4_GROUP, "num_bits": 8, **ASYM}, None),
    "int8-w8a8-asym": ({**INT8_CHANNEL, **ASYM}, {**INT8_TOKENS, **ASYM}),
    "w4a8-int": (INT4_GROUP, INT8_TOKENS),  # int-quantized: 4-bit values saved as int8
    # static activation scales: input_scale is in the checkpoint, read and dropped
    "fp8-tensor-static": (
        {**FP8_CHANNEL, "strategy": "tensor"},
        {**FP8_TOKENS, "strategy": "tensor", "dynamic": False},
    ),
    "fp8-block": (
        {**FP8_CHANNEL, "strategy": "block", "block_structure": [16, 16]},
        {**FP8_TOKENS, "strategy": "group", "group_size": 16},
    ),
}
# the schemes served end to end, with the format compressed-tensors saves each in
SERVED = {
    "w4a16-group": "pack-quantized",
    "w4a16-asym": "pack-quantized",
    "w8a16-channel": "pack-quantized",
    "fp8-channel": "float-quantized",
    "int8-w8a8": "int-quantized",
}


def _min_max(weight: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's range per scale, as llm-compressor's min-max observer takes it."""
    if args.strategy == "group":
        grouped = weight.unflatten(-1, (-1, args.group_size))
        return grouped.amin(-1), grouped.amax(-1)
    if args.strategy == "channel":
        return weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    if args.strategy == "block":
        rows, cols = args.block_structure
        blocks = weight.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols))
        return blocks.amin((1, 3)), blocks.amax((1, 3))
    return weight.amin(), weight.amax()


def compress(model_dir: Path, out: Path, weights: dict, inputs: dict | None) -> Path:
    """`model_dir`'s model quantized and saved by compressed-tensors, every Linear but the
    LM head."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**weights),
        input_activations=None if inputs is None else QuantizationArgs(**inputs),
    )
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        applied = getattr(module, "quantization_scheme", None)
        if applied is None:
            continue
        args = applied.weights
        scale, zero_point = calculate_qparams(*_min_max(module.weight.data, args), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
        if hasattr(module, "input_scale"):  # a static scheme's, from calibration data
            module.input_scale.data.fill_(0.02)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for file in model_dir.glob("tokenizer*"):
        shutil.copy(file, out)
    return out


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory):
    """scheme -> its compressed-tensors checkpoint, made once each."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            weights, inputs = SCHEMES[name]
            made[name] = compress(tiny_llama, tmp_path_factory.mktemp(name), weights, inputs)
        return made[name]

    return make


@pytest.fixture(scope="module")
def decompressed():
    """checkpoint -> transformers' model of it, which compressed-tensors dequantized."""
    made: dict[Path, torch.nn.Module] = {}

    def load(checkpoint: Path) -> torch.nn.Module:
        if checkpoint not in made:
            config = transformers.CompressedTensorsConfig(dequantize=True)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoint, dtype=torch.float32, quantization_config=config
            )
            linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
            assert all(m.weight.dtype == torch.float32 for m in linears)
            assert not any(hasattr(m, "quantization_scheme") for m in model.modules())
            made[checkpoint] = model.eval()
        return made[checkpoint]

    return load


def _prompts() -> list[list[int]]:
    return random_prompts(512, 3, 3, 30, seed=5)


def _serve_greedy(checkpoint: Path, prompts: list[list[int]], **engine) -> list[list[int]]:
    with LLM(model=str(checkpoint), **{**ENGINE, **engine}) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return [out.outputs[0].token_ids for out in outputs]


def _transformers_greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    return [_generate(model, p, MAX_TOKENS, ignore_eos=True) for p in prompts]


@pytest.mark.parametrize("name", SERVED)
def test_greedy_matches_transformers_on_the_decompressed_checkpoint(
    checkpoints, decompressed, tiny_llama, name
):
    checkpoint = checkpoints(name)
    saved = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert saved["format"] == SERVED[name]
    prompts = _prompts()
    got = _serve_greedy(checkpoint, prompts)
    assert got == _transformers_greedy(decompressed(checkpoint), prompts)
    if name == "w4a16-group":  # the rounding shows: not the float model's tokens
        assert got != [hf_greedy(tiny_llama, p, MAX_TOKENS, ignore_eos=True) for p in prompts]


def _load(checkpoint: Path) -> torch.nn.Module:
    config = EngineConfig.create(str(checkpoint)).model
    return load_model(config, checkpoint, load_hf_config(checkpoint), torch.device("cpu"))


def _layers(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, list[str]]]:
    """(our decoder linear, the checkpoint modules it stacks) for every one."""
    for i, layer in enumerate(model.model.layers):
        attention, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        yield layer.self_attn.qkv_proj, [f"{attention}{p}_proj" for p in "qkv"]
        yield layer.self_attn.o_proj, [f"{attention}o_proj"]
        yield layer.mlp.gate_up_proj, [f"{mlp}gate_proj", f"{mlp}up_proj"]
        yield layer.mlp.down_proj, [f"{mlp}down_proj"]


@pytest.mark.parametrize("name", SCHEMES)
def test_weights_are_what_compressed_tensors_decompresses(checkpoints, decompressed, name):
    """Every scheme's layers, kept packed, hold exactly the package's dequantized weights."""
    checkpoint = checkpoints(name)
    ours, theirs = _load(checkpoint), decompressed(checkpoint)
    for layer, modules in _layers(ours):
        assert not hasattr(layer, "weight") or layer.weight.dtype.itemsize == 1
        expected = torch.cat([theirs.get_submodule(m).weight for m in modules])
        assert torch.equal(dequantize(layer.packed_weight, torch.float32), expected)
    assert ours.lm_head.weight.dtype == torch.float32


def test_act_order_groups_are_read_from_weight_g_idx(checkpoints, decompressed, tmp_path):
    """llm-compressor's GPTQ with actorder "group" (which compressed-tensors 0.20 no longer
    writes) saved each input's group in weight_g_idx, a group's inputs scattered. The
    package's group checkpoint with each layer's inputs reordered, codes and groups alike
    (q/k/v in one order, gate/up in one: act order orders the inputs they share), reads as
    the package's weights with their inputs reordered so; its groups whole, each layer
    stores its inputs sorted by group (input_perm), no g_idx left to look up."""
    source = checkpoints("w4a16-group")
    target = tmp_path / "act-order"
    shutil.copytree(source, target)
    state = load_file(str(target / "model.safetensors"))
    shared = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
    orders: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(0)
    for name in sorted(name for name in state if name.endswith(".weight_packed")):
        module = name.removesuffix(".weight_packed")
        shape = torch.Size(state[f"{module}.weight_shape"].tolist())
        parent, _, leaf = module.rpartition(".")
        first = f"{parent}.{shared.get(leaf, leaf)}"
        if first not in orders:
            orders[first] = torch.randperm(shape[1], generator=generator)
        orders[module] = order = orders[first]
        codes = unpack_from_int32(state[name], 4, shape)
        state[name] = pack_to_int32(codes[:, order].contiguous(), 4)
        state[f"{module}.weight_g_idx"] = (order // 16).to(torch.int32)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (target / "config.json").write_text(json.dumps(config))

    ours, theirs = _load(target), decompressed(source)
    assert "act order" in checkpoint_format(load_hf_config(target)).describe()
    for layer, modules in _layers(ours):
        weight = layer.packed_weight
        in_order = torch.arange(weight.in_features) // 16
        assert weight.g_idx is None
        assert torch.equal((orders[modules[0]] // 16)[weight.input_perm], in_order)
        expected = torch.cat([theirs.get_submodule(m).weight[:, orders[m]] for m in modules])
        assert torch.equal(dequantize(layer.packed_weight, torch.float32), expected)


def test_two_ranks_read_their_slices(checkpoints, decompressed):
    """Asymmetric 4-bit: each rank reads its rows of q/k/v and gate/up (their zero points
    packed along the outputs) and its inputs' groups of o/down."""
    checkpoint = checkpoints("w4a16-asym")
    prompts = _prompts()[:2]
    expected = _transformers_greedy(decompressed(checkpoint), prompts)
    got = _serve_greedy(checkpoint, prompts, tensor_parallel_size=2, device=TWO_RANK_DEVICE)
    assert got == expected


W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {**INT4_GROUP, "symmetric": True}}
    },
    "ignore": ["lm_head"],
}


def _config(**changes) -> dict:
    config = json.loads(json.dumps(W4A16))
    config.update(changes)
    return config


def _format(config: dict, tmp_path: Path, tiny_llama: Path) -> QuantFormat | None:
    target = tmp_path / "checkpoint"
    target.mkdir()
    data = json.loads((tiny_llama / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**data, "quantization_config": config}))
    return checkpoint_format(load_hf_config(target))


def _group(**weights) -> dict:
    return {"targets": ["Linear"], "weights": {**INT4_GROUP, **weights}}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            _config(format="nvfp4-pack-quantized"),
            "format 'nvfp4-pack-quantized' \\(NVFP4 weights\\)",
        ),
        (_config(format="marlin-24"), "'marlin-24' \\(2:4 sparse weights in Marlin's layout\\)"),
        (
            _config(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
            "sparsity \\('sparse-24-bitmask', 2:4\\)",
        ),
        (_config(format="dense"), "format 'dense' \\(float weights"),
        (
            _config(config_groups={"g": {**_group(), "weights": {**INT4_GROUP, "type": "float"}}}),
            "4-bit float weights \\(NVFP4, MXFP4\\)",
        ),
        (_config(config_groups={"g": _group(num_bits=3)}), "3-bit int weights"),
        (
            _config(config_groups={"group_0": _group(), "group_1": _group(num_bits=8)}),
            "groups 'group_0' and 'group_1' quantize modules differently \\(pack-quantized "
            "4-bit .*; pack-quantized 8-bit .*\\): serve reads checkpoints with one",
        ),
        (
            _config(config_groups={"g": {**_group(), "output_activations": INT8_TOKENS}}),
            "group 'g' quantizes output activations",
        ),
        (_config(transform_config={"config_groups": {"u": {}}}), "transform_config"),
        (_config(config_groups={"W4A16": ["Linear"]}), "'W4A16' is \\['Linear'\\], a preset"),
    ],
)
def test_what_serve_does_not_read_is_refused_by_name(tiny_llama, tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        _format(config, tmp_path, tiny_llama)


def test_groups_with_one_scheme_and_kv_cache_scales_are_read(tiny_llama, tmp_path):
    """Groups that target different modules with the same weights are one scheme; activation
    and KV-cache scales are dropped: serve runs weight-only, its cache in the model dtype."""
    attention = {**_group(), "targets": ["re:.*self_attn.*"], "input_activations": INT8_TOKENS}
    config = _config(
        config_groups={"group_0": _group(actorder="weight"), "group_1": attention},
        kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"},
    )
    fmt = _format(config, tmp_path, tiny_llama)
    assert (
        fmt.describe()
        == "compressed-tensors pack-quantized 4-bit integer weights, groups of 16, run weight-only"
    )
    assert {"input_scale", "weight_shape", "k_scale", "v_scale"} <= set(fmt.dropped)
