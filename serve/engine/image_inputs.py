"""A model's prompt images, as both front ends take them (the server's chat, the offline
`LLM`): whether the model takes images and how many a prompt may hold (the
`limit_mm_per_prompt` setting), each image read from its URL (`media.py`) or taken as
given (a PIL image), and the prompt's placeholders widened into the images' runs of
tokens (`MultiModalProcessor`). Every refusal is a ValueError that says why; the server
answers it with a 400."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from serve.config import MultiModalConfig
from serve.engine.media import MediaLoader, check_image_size
from serve.engine.multimodal import MultiModalProcessor
from serve.multimodal_inputs import MultiModalInput


@dataclass(frozen=True)
class ImageInputs:
    model_name: str  # as refusals name it
    processor: MultiModalProcessor | None  # None: the model takes no images
    loader: MediaLoader
    limit: int  # the most images a prompt may hold
    # The image processor's keyword arguments (mm_processor_kwargs); a request's over them.
    processor_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_model(
        cls,
        model_path: str | Path,
        tokenizer: Any,
        config: MultiModalConfig,
        model_name: str | None = None,
    ) -> ImageInputs:
        """The images a model at `model_path` takes (its image processor read from there:
        ValueError if it cannot be), under `config`'s limit and local-file directory."""
        from serve.models.loader import load_hf_config  # torch: only when a model loads

        processor = MultiModalProcessor.from_model(
            model_path, load_hf_config(model_path), tokenizer
        )
        loader = MediaLoader.create(config.allowed_local_media_path)
        name = model_name or Path(model_path).name
        return cls(name, processor, loader, config.image_limit, config.processor_kwargs)

    @classmethod
    def text_only(cls, model_name: str) -> ImageInputs:
        return cls(model_name, None, MediaLoader(), 0)

    @property
    def placeholder_text(self) -> str | None:
        """The text that places an image in a prompt (LLaVA's `<image>`); None: no images."""
        return self.processor.placeholder_text if self.processor is not None else None

    def check_count(self, num_images: int) -> None:
        """ValueError for a prompt of `num_images` images the model or the limit refuses."""
        if num_images == 0:
            return
        if self.processor is None:
            raise ValueError(
                f"{self.model_name} takes no images (it is a text-only model): send text alone."
            )
        if num_images > self.limit:
            which = "no images" if self.limit == 0 else f"at most {self.limit} image(s)"
            raise ValueError(
                f"A prompt may hold {which} here (limit_mm_per_prompt, the server's "
                f"--limit-mm-per-prompt); this one has {num_images}."
            )

    def load(self, source: Any) -> Image.Image:
        """One image: a URL read (`MediaLoader`), or a PIL image as given."""
        if isinstance(source, str):
            return self.loader.load_image(source)
        if isinstance(source, Image.Image):
            check_image_size(source, "An image")
            return source
        raise ValueError(f"An image is a URL or a PIL image; got a {type(source).__name__}.")

    def process(
        self,
        prompt_token_ids: list[int],
        images: list[Any],
        processor_kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], tuple[MultiModalInput, ...]]:
        """The prompt with each image's placeholder widened into its run, and the images
        as the engine takes them. For a model that takes images, every prompt goes through
        here: one that holds a placeholder without its image is refused too.
        `processor_kwargs`: a request's own, over the setting's."""
        self.check_count(len(images))
        if self.processor is None:
            return list(prompt_token_ids), ()
        kwargs = self.processor_kwargs | (processor_kwargs or {})
        return self.processor.process(prompt_token_ids, list(images), kwargs)
