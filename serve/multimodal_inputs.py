"""A prompt's images, processed: plain data from the front end to the workers.

The front end decodes each image, runs the model's image processor on it and widens the
image's one placeholder token in the prompt into the run of tokens its embeddings will
take (`MultiModalInput.offset`, `length`). The scheduler sees only the runs and the
images' content hashes (the prefix cache keys a block by the images it holds); the
workers run the vision encoder on the pixels when a step first reaches an image's run,
and its embeddings replace the placeholder tokens' own.

The pixels travel as bytes with their dtype and shape (`ArrayData`), so the step's
messages stay msgpack-encodable and this module needs numpy only to build and read them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ArrayData:
    """An n-dimensional array as plain data."""

    dtype: str  # numpy's name: "float32", "int64", ...
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, array: Any) -> ArrayData:
        """From a numpy array (or anything `np.asarray` takes, a CPU torch tensor too)."""
        array = np.ascontiguousarray(np.asarray(array))
        return cls(str(array.dtype), list(array.shape), array.tobytes())

    def numpy(self) -> np.ndarray:
        """A read-only view of the bytes (no copy)."""
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)


@dataclass(frozen=True)
class MultiModalInput:
    """One image of a prompt: what its encoder takes and where its tokens lie."""

    modality: str  # "image"
    # The content's hash (sha256 hex of the processed pixels): equal hashes, equal
    # embeddings. The prefix cache keys the blocks holding its run by it.
    identifier: str
    offset: int  # the first position of its run of placeholder tokens in the prompt
    length: int  # the run's length: the embeddings the encoder gives for it
    # The processor's outputs for this one item, by name (LLaVA: "pixel_values" [C, H, W]).
    tensors: dict[str, ArrayData] = field(default_factory=dict)
    # Which of the run's tokens take the image's embeddings, in order (bool [length]);
    # None: all of them. Mistral 3's runs hold row breaks and an end token, which are
    # ordinary tokens between the image's.
    is_embed: ArrayData | None = None

    @property
    def num_embeds(self) -> int:
        """The embeddings the encoder gives for it."""
        return self.length if self.is_embed is None else int(self.is_embed.numpy().sum())

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether positions [start, end) hold part of its run."""
        return self.offset < end and start < self.end


def content_hash(modality: str, tensors: dict[str, ArrayData]) -> str:
    """The identifier of processed content: its modality, and each tensor's name, dtype,
    shape and bytes."""
    digest = hashlib.sha256(modality.encode())
    for name in sorted(tensors):
        array = tensors[name]
        digest.update(f"|{name}|{array.dtype}|{array.shape}|".encode())
        digest.update(array.data)
    return digest.hexdigest()


def check_placements(inputs: list[MultiModalInput], num_prompt_tokens: int) -> None:
    """Runs in order, apart, inside the prompt; a ValueError otherwise."""
    last_end = 0
    for item in inputs:
        if item.length < 1 or item.offset < last_end or item.end > num_prompt_tokens:
            raise ValueError(
                f"{item.modality} placeholder run [{item.offset}, {item.end}) does not fit "
                f"a prompt of {num_prompt_tokens} tokens after the run ending at {last_end}."
            )
        last_end = item.end
