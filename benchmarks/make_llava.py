"""Write a LLaVA around the default model, for benchmarks of images in prompts: LLaVA 1.5's
shape with a small language model, built here, nothing downloaded.

    python benchmarks/make_llava.py                   # into ~/.cache/serve/models/
    python benchmarks/make_llava.py --out /tmp/llava-smollm2

The language model is SmolLM2-135M-Instruct as serve converts it (the default model,
float32), with `<image>` added to its tokenizer as one more special token (id 49152: its
49,152 ids are all taken, so the tied embedding grows by one row, drawn as
`resize_token_embeddings` draws it, from the other rows' mean and covariance). The vision
tower has CLIP ViT-B/16's shape at 224 pixels (hidden 768, 12 layers, 12 heads, MLP 3072,
patches of 16: 196 image tokens under the "default" strategy, LLaVA 1.5's feature layer
-2), and the projector is LLaVA's two layers with GELU; both are random (seeded). Outputs
are nonsense; the arithmetic per image and per token is a real LLaVA's of this size.

Saved as transformers saves it, but for the tower's tensors, named as on the hub (see
`_hub_layout`): config.json, model.safetensors, the tokenizer, CLIP's image processor
(resize the short side to 224, centre crop 224, CLIP's mean and std) and a
`LlavaProcessor` (processor_config.json: patch size 16, "default"), which is what vLLM
reads to expand `<image>` in a text prompt.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from serve.models.default_model import resolve_default_model, serve_cache_dir

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 224
PATCH_SIZE = 16
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2  # CLIP's class token dropped ("default")
TOWER = dict(  # CLIP ViT-B/16
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
)


def default_dir() -> Path:
    return serve_cache_dir() / "models" / "llava-smollm2-135m-clip-b16-random"


def is_built(out_dir: Path) -> bool:
    return (out_dir / "processor_config.json").is_file() and any(out_dir.glob("*.safetensors"))


def make_llava(out_dir: Path, seed: int = 0) -> Path:
    """The model in `out_dir`, built there unless it already is. Written to a sibling
    folder and renamed into place, so an interrupted build never looks complete."""
    if is_built(out_dir):
        return out_dir
    text_dir = resolve_default_model()
    tokenizer = transformers.AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**TOWER),
        text_config=transformers.AutoConfig.from_pretrained(text_dir),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=TOKENS_PER_IMAGE,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=True,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    language = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    model.model.language_model.load_state_dict(language.model.state_dict())
    model.resize_token_embeddings(len(tokenizer))  # the tied head follows
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,  # CLIP's class token
    )
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    _hub_layout(partial / "model.safetensors")
    processor.save_pretrained(partial)  # the tokenizer, image processor and processor
    image_processor.save_pretrained(partial)  # preprocessor_config.json, whatever the version
    partial.rename(out_dir)
    return out_dir


def _hub_layout(path: Path) -> None:
    """The tower's tensors under `vision_tower.vision_model.`, as llava-hf's checkpoints
    hold them. transformers 5 writes `vision_tower.` alone (its CLIP vision model lost that
    level), which vLLM 0.32's LLaVA does not map; every loader reads the hub's names."""
    tensors = load_file(path)
    tower = "vision_tower."
    renamed = {
        (tower + "vision_model." + name[len(tower) :] if name.startswith(tower) else name): t
        for name, t in tensors.items()
    }
    save_file(renamed, str(path), metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="default: " + str(default_dir()))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = make_llava(args.out or default_dir(), args.seed)
    print(f"LLaVA (SmolLM2-135M + CLIP ViT-B/16 shape, random tower) in {out}")


if __name__ == "__main__":
    main()
