"""Scoped per-step state for the attention layers.

The model runner enters `forward_context(meta)` around one forward pass; attention layers
read it with `get_forward_context()`. Every other layer is a pure function of its tensors,
so the metadata never threads through layer signatures.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from serve.kernels import AttentionMetadata

_current: AttentionMetadata | None = None


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is already set: forward passes do not nest.")
    _current = meta
    try:
        yield
    finally:
        _current = None


def get_forward_context() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("No forward context: run the model inside `forward_context(meta)`.")
    return _current
