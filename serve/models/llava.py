"""LLaVA: a vision tower (CLIP or SigLIP), a two-layer projector, and any language model
serve runs natively (Llama, Mistral, Qwen2, Gemma, ...), as transformers'
`LlavaForConditionalGeneration` composes them.

An image becomes `tokens_per_image` embeddings: the tower's hidden states at
`vision_feature_layer` (CLIP's class token dropped under the "default" strategy),
projected to the language model's width. The prompt holds a run of placeholder tokens of
that length per image (`engine/multimodal.py` widens them); the rows of those tokens take
the image's embeddings where the language model embeds its tokens (vision_language.py), so
everything after (Gemma's scaling, the layers) is what transformers runs.

The tower is transformers' own module, replicated on every tensor-parallel rank: it runs
once per image, not per token.
"""

from __future__ import annotations

import torch
from torch import nn

from serve.models.arch_config import ArchConfig
from serve.models.layers.activation import get_activation
from serve.models.vision_language import COMPOSITE_RENAMES, VisionLanguageModel


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision_width: int, text_width: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, text_width, bias=bias)
        self.act = get_activation(act)
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    # transformers 5's prefixes, and the hub's llava-hf checkpoints' tower
    # (`vision_tower.vision_model.`; their `language_model.model.` is ours already).
    renames = (*COMPOSITE_RENAMES, ("vision_tower.vision_model.", "vision_tower."))

    def __init__(self, config: ArchConfig) -> None:
        hf = config.hf
        super().__init__(hf)
        from transformers import AutoModel

        self.vision_tower = AutoModel.from_config(hf.vision_config, attn_implementation="sdpa")
        self.multi_modal_projector = LlavaMultiModalProjector(
            hf.vision_config.hidden_size,
            self.text_arch.hidden_size,
            hf.projector_hidden_act,
            bool(getattr(hf, "multimodal_projector_bias", True)),
        )
        self.drop_first = hf.vision_feature_select_strategy == "default"
        # Only the tower's layers up to the one its features come from run (LLaVA 1.5's
        # last of 24 is never read): the rest are dropped, their weights skipped.
        layers = self.vision_tower.encoder.layers
        layer = int(hf.vision_feature_layer)
        needed = layer if layer >= 0 else len(layers) + 1 + layer
        self.unused_prefixes = tuple(
            f"vision_tower.encoder.layers.{i}." for i in range(needed, len(layers))
        )
        del layers[needed:]

    @torch.inference_mode()
    def embed_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's `pixel_values` [channels, height, width] -> [tokens_per_image,
        hidden], the images through the tower as one batch."""
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        pixels = torch.stack([image["pixel_values"] for image in images]).to(dtype)
        out = self.vision_tower(pixels, output_hidden_states=True)
        features = out.hidden_states[-1]  # the last layer kept: the feature layer's output
        if self.drop_first:
            features = features[:, 1:]
        return list(self.multi_modal_projector(features))


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT (1.6): each image is a base view and the tiles of the grid that best fits
    its size, all through the same tower; the tiles' features are laid out as one picture,
    the resize's padding cut off, a learned newline embedding after each row, after the
    base view's (engine/multimodal.AnyResImageLayout counts the same tokens)."""

    own_prefixes = ("vision_tower.", "multi_modal_projector.", "image_newline")
    renames = (("model.image_newline", "image_newline"), *LlavaForConditionalGeneration.renames)

    def __init__(self, config: ArchConfig) -> None:
        super().__init__(config)
        hf = config.hf
        self.image_newline = nn.Parameter(torch.empty(self.text_arch.hidden_size))
        self.grid_pinpoints = [list(p) for p in hf.image_grid_pinpoints]
        self.tile_size = int(hf.vision_config.image_size)
        self.side = self.tile_size // int(hf.vision_config.patch_size)

    @torch.inference_mode()
    def embed_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's views `pixel_values` [1 + tiles, channels, size, size] and
        `image_sizes` [2] (height, width) -> its run of embeddings."""
        from transformers.models.llava_next.modeling_llava_next import (
            get_anyres_image_grid_shape,
            unpad_image,
        )

        views = [image["pixel_values"] for image in images]
        features = super().embed_images([{"pixel_values": v} for v in torch.cat(views)])
        per_view = torch.stack(features)  # [all views, side * side, hidden]
        out, first = [], 0
        for image, pixels in zip(images, views):
            image_features = per_view[first : first + pixels.shape[0]]
            first += pixels.shape[0]
            size = image["image_sizes"].tolist()
            rows, columns = get_anyres_image_grid_shape(size, self.grid_pinpoints, self.tile_size)
            tiles = image_features[1:].view(rows, columns, self.side, self.side, -1)
            # [hidden, rows * side, columns * side]: the tiles as one picture
            picture = tiles.permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
            picture = unpad_image(picture, size)
            newline = self.image_newline[:, None, None].expand(*picture.shape[:-1], 1)
            picture = torch.cat((picture, newline.to(picture.dtype)), dim=-1)
            out.append(torch.cat((image_features[0], picture.flatten(1, 2).transpose(0, 1))))
        return out
