"""A prompt's images made into what the engine runs: the front end's half of multimodal
input, shared by the server and the offline `LLM`.

A model that takes images names one placeholder token (LLaVA's `<image>`, Qwen2-VL's
`<|image_pad|>`); a prompt holds it once per image, where the chat template (or the user)
put it. `process` runs the
model's own image processor (its `preprocessor_config.json`, through transformers) on each
image and widens each placeholder into the run of tokens the image's embeddings take,
returning the prompt's new token ids and one `MultiModalInput` per image. The workers
later replace the run's token embeddings with the image's (`worker/multimodal.py`).

Which families take images, how the processor's output splits into images, and how many
tokens an image takes (fixed for LLaVA; by the tile grid and aspect for LLaVA-NeXT; by the
patch grid for Qwen2-VL) is read off the HF config alone (`image_layout`), so the front end
needs no model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serve.multimodal_inputs import ArrayData, MultiModalInput, content_hash


@dataclass(frozen=True)
class ImageLayout:
    """How a model's prompt holds an image: the processor's output split per image, and
    the run of tokens each image's placeholder is widened into. By default the image is
    its processor's `pixel_values[i]` and its run the placeholder repeated `num_tokens`
    times (one per embedding); a family says otherwise by overriding."""

    placeholder_token_id: int  # the token a prompt holds once per image

    def split(self, processed: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """The image processor's output for a list of images, one dict per image."""
        return [{"pixel_values": pixels} for pixels in processed["pixel_values"]]

    def num_tokens(self, tensors: dict[str, np.ndarray]) -> int:
        """The embeddings one image takes."""
        raise NotImplementedError

    def run_tokens(self, tensors: dict[str, np.ndarray]) -> list[int]:
        """The run's token ids: the placeholder, once per embedding the image takes, for
        every family but Mistral 3's."""
        return [self.placeholder_token_id] * self.num_tokens(tensors)


@dataclass(frozen=True)
class FixedImageLayout(ImageLayout):
    """LLaVA's: every image (resized and cropped) takes the same run."""

    tokens_per_image: int  # the encoder's embeddings per image

    def num_tokens(self, tensors: dict[str, np.ndarray]) -> int:
        return self.tokens_per_image


@dataclass(frozen=True)
class GridImageLayout(ImageLayout):
    """Qwen2-VL's: an image is its patches (`pixel_values` rows, every image's laid end to
    end) on a grid (`image_grid_thw`: frames, rows, columns of patches), and takes one token
    per `merge_size` x `merge_size` patches, so a bigger image takes more."""

    merge_size: int

    def split(self, processed: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        items, start = [], 0
        for grid in processed["image_grid_thw"]:
            count = int(np.prod(grid))
            items.append(
                {
                    "pixel_values": processed["pixel_values"][start : start + count],
                    "image_grid_thw": np.asarray(grid, dtype=np.int64),
                }
            )
            start += count
        return items

    def num_tokens(self, tensors: dict[str, np.ndarray]) -> int:
        return int(np.prod(tensors["image_grid_thw"])) // self.merge_size**2


@dataclass(frozen=True)
class AnyResImageLayout(ImageLayout):
    """LLaVA-NeXT's: an image is a base view plus tiles of the grid (`grid_pinpoints`)
    that best fits its size (`pixel_values[i]`, padded to the batch's most tiles; its
    `image_sizes` row tells how many it has). Its run is the base view's tokens, then the
    tiles' tokens laid out as one picture, the padding the resize added cut off, with a
    newline token after each row: so it grows with the image's size and aspect."""

    image_size: int  # pixels a side of the base view and of each tile
    patch_size: int
    grid_pinpoints: tuple[tuple[int, int], ...]

    def _grid(self, image_size: Any) -> tuple[int, int]:
        """(rows, columns) of tiles for an image of `image_size` (height, width)."""
        from transformers.image_processing_utils import select_best_resolution

        pinpoints = [list(p) for p in self.grid_pinpoints]
        height, width = select_best_resolution([int(n) for n in image_size], pinpoints)
        return height // self.image_size, width // self.image_size

    def split(self, processed: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        items = []
        for pixels, size in zip(processed["pixel_values"], processed["image_sizes"]):
            rows, columns = self._grid(size)
            items.append(
                {
                    "pixel_values": pixels[: 1 + rows * columns],
                    "image_sizes": np.asarray(size, dtype=np.int64),
                }
            )
        return items

    def num_tokens(self, tensors: dict[str, np.ndarray]) -> int:
        height, width = (int(n) for n in tensors["image_sizes"])
        rows, columns = self._grid((height, width))
        side = self.image_size // self.patch_size
        tall, wide = rows * side, columns * side  # the tiles' features as one picture
        # Cut to the image's aspect: the resize padded the shorter way evenly on both sides.
        if width / height > wide / tall:
            pad = (tall - int(round(height * (wide / width), 7))) // 2
            tall -= 2 * pad
        else:
            pad = (wide - int(round(width * (tall / height), 7))) // 2
            wide -= 2 * pad
        return side * side + tall * wide + tall  # base view, tiles, a newline per row


@dataclass(frozen=True)
class RowsImageLayout(ImageLayout):
    """Mistral 3's (Pixtral's tower): an image at its own size (`pixel_values[i]` padded to
    the batch's largest, `image_sizes[i]` its own), one placeholder per `downsample` x
    `downsample` pixels, each row of them ended by a break token, the last by an end
    token. The breaks and the end are text tokens inside the run."""

    downsample: int  # pixels a token covers: the patch size times the merge size
    break_token_id: int
    end_token_id: int

    def split(self, processed: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        return [
            {
                "pixel_values": pixels[:, : int(size[0]), : int(size[1])],
                "image_sizes": np.asarray(size, dtype=np.int64),
            }
            for pixels, size in zip(processed["pixel_values"], processed["image_sizes"])
        ]

    def run_tokens(self, tensors: dict[str, np.ndarray]) -> list[int]:
        height, width = (int(n) // self.downsample for n in tensors["image_sizes"])
        row = [self.placeholder_token_id] * width + [self.break_token_id]
        run = row * height
        run[-1] = self.end_token_id
        return run


def _mistral3_layout(hf: Any, tokenizer: Any) -> ImageLayout:
    if tokenizer is None:
        raise ValueError("Mistral 3's image layout needs its tokenizer (the row tokens).")
    break_id, end_id = tokenizer.convert_tokens_to_ids(["[IMG_BREAK]", "[IMG_END]"])
    if break_id is None or end_id is None or break_id == tokenizer.unk_token_id:
        raise ValueError("Mistral 3's tokenizer lacks [IMG_BREAK] or [IMG_END].")
    downsample = int(hf.vision_config.patch_size) * int(hf.spatial_merge_size)
    return RowsImageLayout(_placeholder_id(hf), downsample, break_id, end_id)


def _placeholder_id(hf: Any) -> int:
    token_id = getattr(hf, "image_token_id", None)
    return int(token_id if token_id is not None else hf.image_token_index)


def _llava_next_layout(hf: Any, tokenizer: Any) -> ImageLayout:
    vision = hf.vision_config
    if vision.model_type != "clip_vision_model" or hf.vision_feature_select_strategy != "default":
        raise ValueError(
            "LLaVA-NeXT is supported with a CLIP tower and the 'default' feature strategy."
        )
    pinpoints = tuple(tuple(int(n) for n in p) for p in hf.image_grid_pinpoints)
    return AnyResImageLayout(
        _placeholder_id(hf), int(vision.image_size), int(vision.patch_size), pinpoints
    )


def _llava_layout(hf: Any, tokenizer: Any) -> ImageLayout:
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
    return FixedImageLayout(_placeholder_id(hf), tokens)


def _qwen2_vl_layout(hf: Any, tokenizer: Any) -> ImageLayout:
    return GridImageLayout(int(hf.image_token_id), int(hf.vision_config.spatial_merge_size))


# HF model_type -> its layout, for the families serve runs with images.
_LAYOUTS = {
    "llava": _llava_layout,
    "llava_next": _llava_next_layout,
    "qwen2_vl": _qwen2_vl_layout,
    "qwen2_5_vl": _qwen2_vl_layout,
    "mistral3": _mistral3_layout,
}


def image_layout(hf_config: Any, tokenizer: Any = None) -> ImageLayout | None:
    """How the model's prompts hold images; None for a model that takes none (ValueError
    for a multimodal config serve cannot run). Mistral 3's needs the tokenizer."""
    layout = _LAYOUTS.get(getattr(hf_config, "model_type", ""))
    return layout(hf_config, tokenizer) if layout is not None else None


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
        layout = image_layout(hf_config, tokenizer)
        if layout is None:
            return None
        import transformers

        # transformers 5 picks a torchvision backend, falling back (with a warning) to PIL
        # where torchvision is missing; serve asks for PIL, which it depends on.
        backend = {"backend": "pil"} if int(transformers.__version__.split(".")[0]) >= 5 else {}
        try:
            image_processor = transformers.AutoImageProcessor.from_pretrained(
                str(model_path), **backend
            )
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{model_path} takes images but its image processor could not be loaded "
                f"(preprocessor_config.json): {e}"
            ) from None
        marks = [layout.placeholder_token_id]
        start = getattr(hf_config, "vision_start_token_id", None)
        end = getattr(hf_config, "vision_end_token_id", None)
        if start is not None and end is not None:  # Qwen2-VL: an image between its markers
            marks = [int(start), *marks, int(end)]
        return cls(layout, image_processor, "".join(tokenizer.convert_ids_to_tokens(marks)))

    def process(
        self,
        prompt_token_ids: list[int],
        images: list[Any],
        processor_kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], tuple[MultiModalInput, ...]]:
        """The prompt with each image's placeholder widened into its run, and the images as
        the engine takes them. `processor_kwargs` go to the image processor's call (vLLM's
        `mm_processor_kwargs`: Qwen2-VL's `min_pixels` / `max_pixels`). ValueError when the
        placeholders and images do not pair up, an image cannot be read or the processor
        refuses its arguments."""
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
        token_ids: list[int] = []
        inputs = []
        last = 0
        for position, arrays in zip(found, self._processed(images, processor_kwargs or {})):
            token_ids += prompt_token_ids[last:position]
            tensors = {name: ArrayData.of(array) for name, array in arrays.items()}
            run = self.layout.run_tokens(arrays)
            is_embed = np.asarray(run) == token_id
            mask = None if is_embed.all() else ArrayData.of(is_embed)
            identifier = content_hash("image", tensors)
            item = MultiModalInput("image", identifier, len(token_ids), len(run), tensors, mask)
            inputs.append(item)
            token_ids += run
            last = position + 1
        token_ids += prompt_token_ids[last:]
        return token_ids, tuple(inputs)

    def _call_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """vLLM's `min_pixels` / `max_pixels` (Qwen2-VL's) as the `size` transformers 5
        takes them in (its bounds on an image's pixels, named `shortest_edge` and
        `longest_edge`); other arguments as given."""
        bounds = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}
        if not (set(bounds) & set(kwargs)) or "size" in kwargs:
            return kwargs
        size = getattr(self.image_processor, "size", None)  # a dict, or transformers' SizeDict
        read = size.get if isinstance(size, dict) else lambda key: getattr(size, key, None)
        current = {key: read(key) for key in bounds.values()}
        if None in current.values():
            return kwargs  # a processor that bounds sizes otherwise takes them as given
        kwargs = dict(kwargs)
        for name, key in bounds.items():
            if name in kwargs:
                current[key] = kwargs.pop(name)
        return kwargs | {"size": current}

    def _processed(
        self, images: list[Any], processor_kwargs: dict[str, Any]
    ) -> list[dict[str, np.ndarray]]:
        from PIL import Image

        from serve.engine.media import to_rgb

        rgb = []
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ValueError(
                    f"Image {i} is a {type(image).__name__}; images are PIL images "
                    "(or, over HTTP, image URLs)."
                )
            rgb.append(to_rgb(image))
        try:
            out = self.image_processor(
                images=rgb, return_tensors="np", **self._call_kwargs(processor_kwargs)
            )
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"The image processor refused mm_processor_kwargs {processor_kwargs}: {e}"
            ) from None
        items = self.layout.split({name: np.asarray(value) for name, value in out.items()})
        for item in items:
            item["pixel_values"] = item["pixel_values"].astype(np.float32, copy=False)
        return items
