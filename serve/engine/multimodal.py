"""A prompt's images made into what the engine runs: the front end's half of multimodal
input, shared by the server and the offline `LLM`.

A model that takes images names one placeholder token (LLaVA's `<image>`); a prompt holds
it once per image, where the chat template (or the user) put it. `process` runs the
model's own image processor (its `preprocessor_config.json`, through transformers) on each
image and widens each placeholder into the run of tokens the image's embeddings take,
returning the prompt's new token ids and one `MultiModalInput` per image. The workers
later replace the run's token embeddings with the image's (`worker/multimodal.py`).

Which families take images, and how many tokens an image takes, is read off the HF config
alone (`image_layout`), so the front end needs no model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serve.multimodal_inputs import ArrayData, MultiModalInput, content_hash


@dataclass(frozen=True)
class ImageLayout:
    """How a model's prompt holds an image."""

    placeholder_token_id: int  # the token a prompt holds once per image
    tokens_per_image: int  # the run it is widened into: the encoder's embeddings per image


def _llava_layout(hf: Any) -> ImageLayout:
    vision = hf.vision_config
    if getattr(vision, "model_type", None) not in ("clip_vision_model", "siglip_vision_model"):
        raise ValueError(
            f"LLaVA with a {getattr(vision, 'model_type', '?')} vision tower is not supported: "
            "serve runs CLIP and SigLIP towers."
        )
    layer = hf.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError("LLaVA with several vision feature layers is not supported.")
    patches = (vision.image_size // vision.patch_size) ** 2
    has_cls = vision.model_type == "clip_vision_model"  # CLIP prepends a class token
    strategy = hf.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported.")
    # "default" drops the first of the tower's outputs (CLIP's class token), "full" keeps all.
    tokens = patches + int(has_cls) - int(strategy == "default")
    token_id = getattr(hf, "image_token_id", None)
    if token_id is None:
        token_id = hf.image_token_index
    return ImageLayout(int(token_id), tokens)


# HF model_type -> its layout, for the families serve runs with images.
_LAYOUTS = {"llava": _llava_layout}


def image_layout(hf_config: Any) -> ImageLayout | None:
    """How the model's prompts hold images; None for a model that takes none (ValueError
    for a multimodal config serve cannot run)."""
    layout = _LAYOUTS.get(getattr(hf_config, "model_type", ""))
    return layout(hf_config) if layout is not None else None


class MultiModalProcessor:
    """Images into a prompt, for one model (`from_model`; None if it takes no images)."""

    def __init__(self, layout: ImageLayout, image_processor: Any, placeholder_text: str) -> None:
        self.layout = layout
        self.image_processor = image_processor
        # The placeholder as text, for prompts and chat templates that write it.
        self.placeholder_text = placeholder_text

    @classmethod
    def from_model(
        cls, model_path: str | Path, hf_config: Any, tokenizer: Any
    ) -> MultiModalProcessor | None:
        layout = image_layout(hf_config)
        if layout is None:
            return None
        from transformers import AutoImageProcessor

        try:
            image_processor = AutoImageProcessor.from_pretrained(str(model_path))
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{model_path} takes images but its image processor could not be loaded "
                f"(preprocessor_config.json): {e}"
            ) from None
        text = tokenizer.convert_ids_to_tokens(layout.placeholder_token_id)
        return cls(layout, image_processor, text)

    def process(
        self, prompt_token_ids: list[int], images: list[Any]
    ) -> tuple[list[int], tuple[MultiModalInput, ...]]:
        """The prompt with each image's placeholder widened into its run, and the images as
        the engine takes them. ValueError when the placeholders and images do not pair up
        or an image cannot be read."""
        token_id = self.layout.placeholder_token_id
        found = [i for i, t in enumerate(prompt_token_ids) if t == token_id]
        if len(found) != len(images):
            raise ValueError(
                f"The prompt holds {len(found)} image placeholder{'s' * (len(found) != 1)} "
                f"({self.placeholder_text}) for {len(images)} image{'s' * (len(images) != 1)}: "
                "each image needs one, where it goes."
            )
        if not images:
            return list(prompt_token_ids), ()
        pixel_values = self._pixel_values(images)
        run = self.layout.tokens_per_image
        token_ids: list[int] = []
        inputs = []
        last = 0
        for position, pixels in zip(found, pixel_values):
            token_ids += prompt_token_ids[last:position]
            tensors = {"pixel_values": ArrayData.of(pixels)}
            identifier = content_hash("image", tensors)
            inputs.append(MultiModalInput("image", identifier, len(token_ids), run, tensors))
            token_ids += [token_id] * run
            last = position + 1
        token_ids += prompt_token_ids[last:]
        return token_ids, tuple(inputs)

    def _pixel_values(self, images: list[Any]) -> list[np.ndarray]:
        from PIL import Image

        rgb = []
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ValueError(
                    f"Image {i} is a {type(image).__name__}; images are PIL images "
                    "(or, over HTTP, image URLs)."
                )
            rgb.append(image.convert("RGB") if image.mode != "RGB" else image)
        out = self.image_processor(images=rgb, return_tensors="np")["pixel_values"]
        return [np.asarray(p, dtype=np.float32) for p in out]
