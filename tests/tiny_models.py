"""Tiny random-weight models and an offline tokenizer for tests, plus an HF greedy oracle.

Everything is built locally: a byte-level BPE trained on the corpus below, and 2-layer
models (hidden 64, GQA 4:2, head_dim 16) from transformers configs, saved as safetensors.
The weights are re-initialised wider than HF's default (std 0.2) so that greedy decoding
wanders over the vocabulary instead of repeating one token, and so argmax gaps are far
larger than float32 round-off between our kernels and HF's.
"""

from __future__ import annotations

import copy
import functools
import inspect
import random
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)  # trained first: ids 0, 1, 2
VOCAB_SIZE = 512

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving engine turns requests into tokens,
and tokens into text, one step at a time. Each step the scheduler decides which sequences
run and how many tokens each of them computes, within the budget of the batch.

Once upon a time there was a small model with two layers and a tiny vocabulary. It lived
in a temporary directory and answered every question with confident nonsense. The tests
loved it anyway, because it was fast, deterministic, and never needed the network.

Hello, world! How are you today? I am fine, thank you. What is the capital of France?
The capital of France is Paris. Please write a short poem about the sea and the sky.
The sea is wide and blue; the sky is high and bright. Birds fly over the water at night.

Paged attention stores keys and values in fixed-size blocks. A block table maps the
logical blocks of a sequence to physical blocks in memory, so sequences can grow without
copying, share a common prefix, and give their memory back the moment they finish.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 3.14159 2.71828 -7 +8 1e-5.
Punctuation: . , ; : ! ? ' " ( ) [ ] { } < > / \\ | - _ = + * & ^ % $ # @ ~ `
def main(): return {"id": 1, "object": "chat.completion", "choices": [], "usage": None}
"""


@functools.lru_cache(maxsize=1)
def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE (vocab 512) with ChatML specials; eos = bos = pad = <|endoftext|>."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )


def make_tiny_config(arch: str, **overrides) -> transformers.PretrainedConfig:
    """The tiny shape (hidden 64, 2 layers, 4 heads over 2 KV heads, head_dim 16) of family
    `arch` (a key of model_families.FAMILIES or BACKEND_FAMILIES), its own fields, then
    `overrides`."""
    from model_families import FAMILIES_BY_KEY

    if arch not in FAMILIES_BY_KEY:
        raise ValueError(f"arch must be one of {sorted(FAMILIES_BY_KEY)}, got {arch!r}.")
    family = FAMILIES_BY_KEY[arch]
    tokenizer = build_tokenizer()
    kwargs = dict(
        architectures=[family.architecture],
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.2,  # documents _perturb_'s std; from_config's init is replaced
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    for name in family.drop:
        kwargs.pop(name, None)
    # Copies: transformers fills nested dicts (rope_parameters) in place.
    kwargs.update(copy.deepcopy(family.config))
    kwargs.update(copy.deepcopy(overrides))
    return transformers.AutoConfig.for_model(family.model_type, **kwargs)


def _perturb_(model: torch.nn.Module, std: float) -> None:
    """Re-initialise every parameter: norm weights 1 ± 0.1, everything else (norm biases
    too) N(0, std); and the checkpoint buffers a router reads (DeepSeek-V3's correction
    bias), N(0, std)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and not name.endswith("bias"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, std)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, std)


def _greedy_generation_config(model, max_new_tokens: int, ignore_eos: bool):
    """The model's generation config, greedy. `ignore_eos` drops EOS so generation runs to
    `max_new_tokens` with no logits processor added (`min_new_tokens` would mask EOS)."""
    config = model.generation_config.to_dict()
    config.update(do_sample=False, max_new_tokens=max_new_tokens)
    config.update(pad_token_id=model.config.get_text_config().pad_token_id)
    if ignore_eos:
        config["eos_token_id"] = []  # None would be refilled from the model's config
    return transformers.GenerationConfig(**config)


def _generate(model, prompt_token_ids: list[int], max_new_tokens: int, ignore_eos: bool):
    input_ids = torch.tensor([prompt_token_ids], dtype=torch.long)
    config = _greedy_generation_config(model, max_new_tokens, ignore_eos)
    with torch.no_grad():
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
        )
    return output[0, len(prompt_token_ids) :].tolist()


def make_tiny_model(
    arch: str, out_dir: Path, *, seed: int = 0, check_degenerate: bool = True, **overrides
) -> Path:
    """Build, perturb and save a tiny model of family `arch` (model_families.py) with the
    tiny tokenizer into `out_dir`; `overrides` update the transformers config. A model whose
    greedy output repeats a token or three tests nothing and raises, unless the caller (a
    benchmark, which only times it) says `check_degenerate=False`."""
    config = make_tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_(model, std=config.initializer_range)
    model.eval()
    if check_degenerate:
        probe = random_prompts(len(build_tokenizer()), 1, 8, 8, seed=seed)[0]
        new_token_ids = _generate(model, probe, 20, ignore_eos=True)
        if len(set(new_token_ids)) <= 3:
            raise RuntimeError(f"tiny {arch} model is degenerate: greedy gave {new_token_ids}")
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer().save_pretrained(out_dir)
    return out_dir


_hf_models: dict[str, torch.nn.Module] = {}


def _hf_model(model_dir: Path) -> torch.nn.Module:
    key = str(Path(model_dir).resolve())
    if key not in _hf_models:
        model = transformers.AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32)
        _hf_models[key] = model.eval()
    return _hf_models[key]


def hf_log_softmax(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """HF's float32 log-probabilities at every position of `token_ids`: row p is the
    distribution of the token after position p. [len(token_ids), vocab]."""
    input_ids = torch.tensor([token_ids], dtype=torch.long)
    with torch.no_grad():
        logits = _hf_model(model_dir)(input_ids).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def hf_embedding(
    model_dir: Path,
    token_ids: list[int],
    pooling_type: str = "last",
    normalize: bool = True,
    dimensions: int | None = None,
) -> torch.Tensor:
    """HF's float32 embedding of `token_ids`: the final hidden states (transformers'
    `hidden_states[-1]`, which is after the final norm, as `last_hidden_state` is)
    pooled at the last token, the first (cls) or by the mean, truncated, L2-normalised."""
    input_ids = torch.tensor([token_ids], dtype=torch.long)
    with torch.no_grad():
        hidden = _hf_model(model_dir)(input_ids, output_hidden_states=True).hidden_states[-1][0]
    pooled = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(dim=0)}[pooling_type]
    if dimensions is not None:
        pooled = pooled[:dimensions]
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


def write_sentence_transformers_config(
    model_dir: Path, pooling_mode: str, normalize: bool = True
) -> Path:
    """Make `model_dir` a sentence-transformers model: modules.json (Transformer, Pooling,
    optionally Normalize) and 1_Pooling/config.json with `pooling_mode` ("lasttoken",
    "mean_tokens", "cls_token", ...) on."""
    import json

    kinds = [("", "Transformer"), ("1_Pooling", "Pooling")]
    if normalize:
        kinds.append(("2_Normalize", "Normalize"))
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    model_dir = Path(model_dir)
    (model_dir / "modules.json").write_text(json.dumps(modules))
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
    config = {f"pooling_mode_{mode}": mode == pooling_mode for mode in modes}
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    (model_dir / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **config, "include_prompt": True})
    )
    return model_dir


def hf_greedy(
    model_dir: Path, prompt_token_ids: list[int], max_new_tokens: int, ignore_eos: bool = False
) -> list[int]:
    """HF transformers' greedy continuation in float32: the new token ids only.

    Stops after EOS (included in the result) as HF does by default; with `ignore_eos`,
    runs to `max_new_tokens` without changing any logits.
    """
    return _generate(_hf_model(model_dir), list(prompt_token_ids), max_new_tokens, ignore_eos)


def hf_beam_search(
    model_dir: Path,
    prompt: list[int],
    width: int,
    max_new_tokens: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> list[tuple[list[int], float]]:
    """HF's beams in float32, best first, as (new token ids, cumulative logprob), stopping
    at the model's own EOS. For width 1 HF runs greedy search (whatever `early_stopping`
    says): its single sequence."""
    model = _hf_model(model_dir)
    input_ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            max_new_tokens=max_new_tokens,
            eos_token_id=[model.config.eos_token_id],
            pad_token_id=model.config.pad_token_id,
            return_dict_in_generate=True,
            output_scores=True,
        )
    if width == 1:
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [torch.log_softmax(s[0], dim=-1)[t].item() for s, t in zip(out.scores, tokens)]
        return [(tokens, sum(logprobs))]
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()  # output tokens of each beam
    return [
        (
            out.sequences[i, len(prompt) : len(prompt) + n].tolist(),
            out.sequences_scores[i].item() * n**length_penalty,
        )
        for i, n in enumerate(lengths)
    ]


def random_prompts(
    tokenizer_or_vocab_size, n: int, min_len: int, max_len: int, seed: int
) -> list[list[int]]:
    """`n` prompts of random token ids, lengths in [min_len, max_len], no special tokens.

    An int vocab size assumes the tiny tokenizer's layout (special tokens first).
    """
    if isinstance(tokenizer_or_vocab_size, int):
        vocab_size, special_ids = tokenizer_or_vocab_size, set(range(len(SPECIAL_TOKENS)))
    else:
        vocab_size = len(tokenizer_or_vocab_size)
        special_ids = set(tokenizer_or_vocab_size.all_special_ids)
    allowed = [i for i in range(vocab_size) if i not in special_ids]
    rng = random.Random(seed)
    return [rng.choices(allowed, k=rng.randint(min_len, max_len)) for _ in range(n)]


def make_tiny_lora(
    model_dir: Path,
    out_dir: Path,
    *,
    targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj"),
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 0,
    std: float = 0.3,
    **config_fields,
) -> Path:
    """A random LoRA adapter for the tiny model in `model_dir`, saved as PEFT saves one
    (adapter_config.json, adapter_model.safetensors: `base_model.model.<module>.lora_A/B.
    weight`), on every module whose name ends in one of `targets`. Both A and B are random
    (PEFT starts B at zero, which would change nothing)."""
    import json

    from safetensors.torch import save_file
    from transformers.pytorch_utils import Conv1D

    model = _hf_model(model_dir)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.split(".")[-1] not in targets:
            continue
        if isinstance(module, torch.nn.Linear):
            fan_in, fan_out = module.in_features, module.out_features
        elif isinstance(module, Conv1D):  # GPT-2's, weight [in, out]; PEFT's A, B as Linear's
            fan_in, fan_out = module.weight.shape
        else:
            continue
        a = torch.randn(rank, fan_in, generator=generator) * std
        b = torch.randn(fan_out, rank, generator=generator) * std
        tensors[f"base_model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.weight"] = b
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "bias": "none",
        "base_model_name_or_path": str(model_dir),
        "task_type": "CAUSAL_LM",
        **config_fields,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return out_dir


def merge_tiny_lora(model_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """The oracle for an adapter: the base model with W + scale * B @ A written into each
    adapted module's weight (as PEFT's merge does), saved as a model of its own."""
    import json
    import math

    from safetensors.torch import load_file

    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            rank = a.shape[0]
            alpha = config["lora_alpha"]
            scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
            update = scale * (b.double() @ a.double()).float()  # [out, in]
            weight = modules[name].weight
            weight += update if weight.shape == update.shape else update.t()  # Conv1D: [in, out]
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer().save_pretrained(out_dir)
    return out_dir


IMAGE_TOKEN = "<image>"
# ChatML whose messages' content may be a list of parts: an image part writes the
# placeholder (as llava-hf's templates do), a text part its text.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAVA_IMAGE_SIZE = 28  # pixels a side after the processor's resize and crop
LLAVA_TOKENS_PER_IMAGE = 16  # (28 / 7) ** 2 patches; CLIP's class token dropped ("default")


def build_llava_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The tiny tokenizer with `<image>` as one more special token (id 512) and a chat
    template that writes it for image parts."""
    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    return tokenizer


LLAVA_NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56]]


def make_tiny_llava(
    out_dir: Path,
    *,
    seed: int = 0,
    text_arch: str = "llama",
    tower: str = "clip",
    next_tiles: bool = False,
) -> Path:
    """A tiny LLaVA (a 2-layer vision tower on 28-pixel images, the projector, the tiny
    `text_arch` language model) with its image processor and tokenizer, saved as
    transformers saves it. `tower`: "clip" (LLaVA 1.5's: its class token dropped, 16 image
    tokens) or "siglip" (LLaVA-Interleave's: no class token, every output kept, 16 too).
    `next_tiles`: LLaVA-NeXT, whose image is a base view plus 2 to 4 tiles of 28 pixels
    (`LLAVA_NEXT_PINPOINTS`), with a newline embedding after each row of tile features."""
    tokenizer = build_llava_tokenizer()
    text_config = make_tiny_config(text_arch, vocab_size=len(tokenizer))
    shape = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=LLAVA_IMAGE_SIZE,
        patch_size=7,
    )
    if tower == "clip":
        vision_config = transformers.CLIPVisionConfig(projection_dim=32, **shape)
        strategy = "default"
    else:
        vision_config = transformers.SiglipVisionConfig(**shape)
        strategy = "full"
    config_class = transformers.LlavaNextConfig if next_tiles else transformers.LlavaConfig
    extra = {"image_grid_pinpoints": LLAVA_NEXT_PINPOINTS} if next_tiles else {}
    config = config_class(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy=strategy,
        dtype="float32",
        **extra,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    _perturb_(model, std=0.2)
    model.eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if next_tiles:
        processor = transformers.LlavaNextImageProcessor(
            size={"shortest_edge": LLAVA_IMAGE_SIZE},
            crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE},
            image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
        )
    elif tower == "clip":
        processor = transformers.CLIPImageProcessor(
            size={"shortest_edge": LLAVA_IMAGE_SIZE},
            crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE},
        )
    else:
        size = {"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE}
        processor = transformers.SiglipImageProcessor(size=size)
    processor.save_pretrained(out_dir)
    return out_dir


def random_image(seed: int, width: int = 40, height: int = 32):
    """A PIL image of random pixels (a size the processor must resize and crop)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
QWEN_VL_CHAT_TEMPLATE = LLAVA_CHAT_TEMPLATE.replace(
    "{{ '<image>' }}", "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
)


def build_qwen_vl_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The tiny tokenizer with Qwen2-VL's image tokens (ids 512-514) and a chat template
    that writes `<|vision_start|><|image_pad|><|vision_end|>` for image parts."""
    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.add_tokens(list(QWEN_VL_TOKENS), special_tokens=True)
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    return tokenizer


def make_tiny_qwen2_vl(out_dir: Path, *, seed: int = 0, version: str = "2") -> Path:
    """A tiny Qwen2-VL (`version` "2") or Qwen2.5-VL ("2.5"): a 2-layer vision transformer
    on 14-pixel patches merged 2 x 2, before the tiny Qwen2 with M-RoPE (sections 2, 3, 3 of
    its 8 frequencies); its image processor takes 56 to 112 pixels a side (4 to 16 tokens
    an image, by its size)."""
    tokenizer = build_qwen_vl_tokenizer()
    start, end, pad = tokenizer.convert_tokens_to_ids(list(QWEN_VL_TOKENS))
    text = make_tiny_config("qwen2", vocab_size=len(tokenizer)).to_dict()
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    text["rope_parameters"]["mrope_section"] = [2, 3, 3]
    vision = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2)
    vision.update(temporal_patch_size=2, hidden_size=64)
    if version == "2":
        config_class, model_class = (
            transformers.Qwen2VLConfig,
            transformers.Qwen2VLForConditionalGeneration,
        )
        text["model_type"] = "qwen2_vl_text"
        vision.update(embed_dim=32, mlp_ratio=2)
    else:
        config_class = transformers.Qwen2_5_VLConfig
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
        text["model_type"] = "qwen2_5_vl_text"
        # Windowed attention on all but the last block (fullatt_block_indexes), as 2.5's.
        vision.update(intermediate_size=64, out_hidden_size=64, hidden_size=32)
        vision.update(window_size=56, fullatt_block_indexes=[1])
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=pad,
        vision_start_token_id=start,
        vision_end_token_id=end,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = model_class(config)
    _perturb_(model, std=0.2)
    out_dir = Path(out_dir)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    transformers.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(
        out_dir
    )
    return out_dir


def hf_vl_greedy(
    model_dir: Path,
    prompt_token_ids: list[int],
    images: list,
    max_new_tokens: int,
    processor_kwargs: dict | None = None,
) -> list[int]:
    """HF's greedy continuation (new token ids, EOS ignored) of a vision-language model
    (any `AutoModelForImageTextToText`) in float32, the prompt already widened, the image
    tensors from the model's own image processor."""
    key = "vl:" + str(Path(model_dir).resolve())
    if key not in _hf_models:
        model = transformers.AutoModelForImageTextToText.from_pretrained(
            model_dir, dtype=torch.float32
        )
        _hf_models[key] = model.eval()
    model = _hf_models[key]
    input_ids = torch.tensor([prompt_token_ids], dtype=torch.long)
    kwargs = {}
    if images:
        processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
        kwargs.update(processor(images=images, return_tensors="pt", **(processor_kwargs or {})))
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # Qwen2-VL
            image_token = model.config.image_token_id
            kwargs["mm_token_type_ids"] = (input_ids == image_token).to(torch.int32)
    config = _greedy_generation_config(model, max_new_tokens, ignore_eos=True)
    with torch.no_grad():
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config, **kwargs
        )
    return output[0, len(prompt_token_ids) :].tolist()


MISTRAL3_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")


def make_tiny_mistral3(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny Mistral 3: a 2-layer Pixtral tower on 7-pixel patches merged 2 x 2 (a token
    per 14 pixels, images up to 56 pixels a side), before the tiny Mistral; the tokenizer
    has `[IMG]`, `[IMG_BREAK]`, `[IMG_END]` (ids 512-514) and writes `[IMG]` for image
    parts. Its LM head is tied to the embedding, as Mistral3Config's default."""
    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.add_tokens(list(MISTRAL3_TOKENS), special_tokens=True)
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE.replace("{{ '<image>' }}", "{{ '[IMG]' }}")
    vision = transformers.PixtralVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=16,
        image_size=56,
        patch_size=7,
    )
    config = transformers.Mistral3Config(
        vision_config=vision,
        text_config=make_tiny_config("mistral", vocab_size=len(tokenizer)),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        vision_feature_layer=-1,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = transformers.Mistral3ForConditionalGeneration(config)
    _perturb_(model, std=0.2)
    out_dir = Path(out_dir)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    transformers.PixtralImageProcessor(size={"longest_edge": 56}, patch_size=7).save_pretrained(
        out_dir
    )
    return out_dir
