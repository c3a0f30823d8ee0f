"""Qwen2-VL and Qwen2.5-VL: transformers' vision transformer (images cut into 14-pixel
patches on a grid that follows the image's size, each 2 x 2 patches merged into one token)
before a Qwen2 language model whose rotary embedding is M-RoPE.

M-RoPE gives each token three positions: text tokens (p, p, p); an image's tokens its
grid's (frame, row, column) offset by the position the image starts at; and the text after
an image continues from that start plus the image's longer side in tokens, not from its
token count. So a token's positions depend on the images before it: `multimodal_positions`
computes them per step from each sequence's images (`MultiModalInput.offset`, its grid),
for prompt chunks and decodes alike. The rotation itself is
`layers/rotary.MultimodalRotaryEmbedding`, which the Qwen2 layers get from the config's
`mrope_section`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from serve.models.arch_config import ArchConfig
from serve.models.vision_language import VisionLanguageModel
from serve.multimodal_inputs import MultiModalInput

_TOWERS = {
    "qwen2_vl": "transformers.models.qwen2_vl.modeling_qwen2_vl."
    "Qwen2VisionTransformerPretrainedModel",
    "qwen2_5_vl": "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl."
    "Qwen2_5_VisionTransformerPretrainedModel",
}


def _tower_class(model_type: str) -> Any:
    import importlib

    module, name = _TOWERS[model_type].rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def image_positions(
    items: tuple[MultiModalInput, ...], start: int, count: int, merge_size: int
) -> np.ndarray:
    """[3, count] M-RoPE positions of a sequence's tokens [start, start + count)."""
    positions = np.tile(np.arange(start, start + count, dtype=np.int64), (3, 1))
    end = start + count
    shift = 0  # how far text positions lag token indices after the images so far
    for item in items:
        frames, rows, columns = (int(n) for n in item.tensors["image_grid_thw"].numpy())
        rows, columns = rows // merge_size, columns // merge_size
        base = item.offset + shift  # the position the image starts at
        lo, hi = max(start, item.offset), min(end, item.end)
        if lo < hi:
            k = np.arange(lo - item.offset, hi - item.offset)
            positions[0, lo - start : hi - start] = base + k // (rows * columns)
            positions[1, lo - start : hi - start] = base + (k // columns) % rows
            positions[2, lo - start : hi - start] = base + k % columns
        grown = shift + max(rows, columns) - item.length
        after = max(start, item.end)
        if after < end:
            positions[:, after - start :] += grown - shift
        shift = grown
    return positions


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    own_prefixes = ("visual.",)
    # The hub's checkpoints (`model.layers.`, `visual.`) and transformers 5's
    # (`model.language_model.`, `model.visual.`).
    renames = (
        ("model.language_model.", "language_model.model."),
        ("model.visual.", "visual."),
        ("model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
    )

    @classmethod
    def text_architecture(cls, hf: Any) -> str:
        return "Qwen2ForCausalLM"  # its text_config names its own (M-RoPE) class

    def __init__(self, config: ArchConfig) -> None:
        hf = config.hf
        super().__init__(hf)
        tower = _tower_class(hf.model_type)
        self.visual = tower._from_config(hf.vision_config, attn_implementation="sdpa")
        self.merge_size = int(hf.vision_config.spatial_merge_size)

    @torch.inference_mode()
    def embed_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's patches [patches, features] and grid [3] -> [patches / merge^2,
        hidden], all images through the tower in one call (its attention stays within
        each image)."""
        dtype = next(self.visual.parameters()).dtype
        pixels = torch.cat([image["pixel_values"] for image in images]).to(dtype)
        grids = torch.stack([image["image_grid_thw"] for image in images])
        merged = self.visual(pixels, grid_thw=grids).pooler_output
        sizes = (grids.prod(-1) // self.merge_size**2).tolist()
        return list(torch.split(merged, sizes))

    def multimodal_positions(
        self,
        positions: torch.Tensor,
        mm_rows: list[tuple[tuple[MultiModalInput, ...], int, int, int]],
    ) -> torch.Tensor:
        """[T] token positions -> [3, T]: (p, p, p) for sequences without images, M-RoPE's
        for each sequence with some (its images, first position, tokens, first row)."""
        out = positions.unsqueeze(0).repeat(3, 1)
        for items, start, count, row in mm_rows:
            rows = image_positions(items, start, count, self.merge_size)
            out[:, row : row + count] = torch.from_numpy(rows).to(out.device)
        return out
