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

import numpy as np
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
                if values.shape[0] != item.num_embeds:
                    raise RuntimeError(
                        f"the encoder gave {values.shape[0]} embeddings for an image that "
                        f"takes {item.num_embeds}"
                    )
                embeddings[identifier] = values
        parts = [_span_rows(s, embeddings[s.item.identifier], self.device) for s in spans]
        rows = torch.cat([r for r, _ in parts])
        values = torch.cat([v for _, v in parts])
        # Kept: the images a chunk stopped inside of.
        self._kept = {
            s.item.identifier: embeddings[s.item.identifier]
            for s in spans
            if s.first + s.count < s.item.length
        }
        return rows, values


def _span_rows(
    span: ImageSpan, embeddings: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-stream rows a span's embeddings go to, and those embeddings: every token
    of the span's part of the run, or only those its mask names (the others are text)."""
    first, count = span.first, span.count
    if span.item.is_embed is None:
        rows = torch.arange(span.row, span.row + count, device=device)
        return rows, embeddings[first : first + count]
    mask = span.item.is_embed.numpy()
    before = int(mask[:first].sum())  # the embeddings of the run's earlier part
    taken = np.flatnonzero(mask[first : first + count])
    rows = torch.from_numpy(taken + span.row).to(device)
    return rows, embeddings[before : before + len(taken)]
