"""Mistral 3 (Mistral Small 3.1 / 3.2 with vision): transformers' Pixtral tower (images at
their own size, 2-D rotary over the patch grid), its projector (an RMSNorm, a 2 x 2 patch
merger, two linears), before a Mistral language model.

An image's run holds a row break after each row of its tokens and an end token after the
last (engine/multimodal.RowsImageLayout); those are text, and only the run's `[IMG]`
tokens take the image's embeddings (`MultiModalInput.is_embed`).
"""

from __future__ import annotations

import torch

from serve.models.arch_config import ArchConfig
from serve.models.vision_language import VisionLanguageModel


class Mistral3ForConditionalGeneration(VisionLanguageModel):
    def __init__(self, config: ArchConfig) -> None:
        hf = config.hf
        super().__init__(hf)
        from transformers import AutoModel
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        if not isinstance(hf.vision_feature_layer, int):
            raise ValueError("Mistral 3 with several vision feature layers is not supported.")
        self.vision_tower = AutoModel.from_config(hf.vision_config, attn_implementation="sdpa")
        self.multi_modal_projector = Mistral3MultiModalProjector(hf)
        self.feature_layer = hf.vision_feature_layer
        self.downsample = int(hf.vision_config.patch_size) * int(hf.spatial_merge_size)

    @torch.inference_mode()
    def embed_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's `pixel_values` [channels, height, width] at its own size and its
        `image_sizes` [2] -> one embedding per `downsample`-pixel square, row by row."""
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        sizes = torch.stack([image["image_sizes"] for image in images])
        height, width = (int(n) for n in sizes.max(dim=0).values)
        pixels = torch.zeros(len(images), 3, height, width, dtype=dtype, device=sizes.device)
        for i, image in enumerate(images):  # the tower reads each image's own corner
            h, w = image["pixel_values"].shape[-2:]
            pixels[i, :, :h, :w] = image["pixel_values"]
        out = self.vision_tower(pixels, image_sizes=sizes, output_hidden_states=True)
        features = out.hidden_states[self.feature_layer].squeeze(0)
        merged = self.multi_modal_projector(features, sizes)
        counts = (sizes // self.downsample).prod(dim=-1).tolist()
        return list(torch.split(merged, counts))
