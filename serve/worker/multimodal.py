"""The images' embeddings a step's forward takes: the vision encoder run on each image
when a prompt chunk first reaches its placeholder tokens, and kept while a chunked prompt
is still inside the image.

The encoder gives an image's whole run of embeddings at once, while chunked prefill may
cut the run across steps: an image cut at a chunk's end keeps its embeddings for the next
step (`ImageEmbeddings.for_step`); any other is dropped after the step that finished it.
One image sent by several requests in the same step is encoded once (its content hash
names it). A sequence preempted inside an image, or whose next chunk waits a step, has its
image encoded again when it resumes: the cost of an encoder run, never a wrong row.
"""

from __future__ import annotations

from typing import Any

import torch

from serve.worker.model_inputs import ImageSpan


class ImageEmbeddings:
    """One model's image embeddings for the steps (every rank runs its own: the tower is
    replicated)."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self._kept: dict[str, torch.Tensor] = {}  # identifier -> [tokens, hidden]

    def for_step(self, spans: list[ImageSpan]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the token stream, their embeddings) for the step's image spans."""
        if not spans:
            self._kept.clear()
            return None
        embeddings = dict(self._kept)
        todo: dict[str, Any] = {}
        for span in spans:
            if span.item.identifier not in embeddings:
                todo.setdefault(span.item.identifier, span.item)
        if todo:
            tensors = [
                {
                    name: torch.from_numpy(array.numpy().copy()).to(self.device)
                    for name, array in item.tensors.items()
                }
                for item in todo.values()
            ]
            encoded = self.model.embed_images(tensors)
            for identifier, item, values in zip(todo, todo.values(), encoded):
                if values.shape[0] != item.length:
                    raise RuntimeError(
                        f"the encoder gave {values.shape[0]} embeddings for an image whose "
                        f"run is {item.length} tokens"
                    )
                embeddings[identifier] = values
        rows = torch.cat([torch.arange(s.row, s.row + s.count, device=self.device) for s in spans])
        values = torch.cat(
            [embeddings[s.item.identifier][s.first : s.first + s.count] for s in spans]
        )
        # Kept: the images a chunk stopped inside of.
        self._kept = {
            s.item.identifier: embeddings[s.item.identifier]
            for s in spans
            if s.first + s.count < s.item.length
        }
        return rows, values
