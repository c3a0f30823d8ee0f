"""POST /v1/embeddings: OpenAI's request and response shapes (pydantic).

OpenAI's rules, checked at the door: `input` is a string, a list of strings, a list of
token ids or a list of such lists, never empty (nor an empty string), at most
MAX_EMBEDDING_INPUTS entries; `encoding_format` is "float" or "base64"; `dimensions` is
positive. Whether the model may be truncated to `dimensions` is the engine's check.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator

from serve.api.protocol import OpenAIModel, Priority, TruncatePromptTokens

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on the entries of one request's `input`


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's extra: with --scheduling-policy priority, lower runs first.
    priority: int = Priority
    truncate_prompt_tokens: int | None = TruncatePromptTokens

    @field_validator("input")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, str):
            if not v:
                raise ValueError("must not be an empty string")
            return v
        if not v:
            raise ValueError("must not be an empty list")
        if len(v) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"has {len(v)} entries; at most {MAX_EMBEDDING_INPUTS} are allowed")
        if isinstance(v[0], str) and any(not text for text in v):
            raise ValueError("must not hold an empty string")
        if isinstance(v[0], list) and any(not ids for ids in v):
            raise ValueError("must not hold an empty list of token ids")
        return v

    @property
    def inputs(self) -> list[str | list[int]]:
        """Each input, a text or a list of token ids, in order."""
        raw = self.input
        if isinstance(raw, str) or isinstance(raw[0], int):
            return [raw]  # type: ignore[list-item]
        return list(raw)  # type: ignore[arg-type]


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as the response carries it: floats, or base64 of little-endian float32
    bytes (what the openai SDK decodes with numpy's `frombuffer(..., dtype="float32")`)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def embedding_response(
    model: str, vectors: list[list[float]], encoding_format: str, num_prompt_tokens: int
) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_embedding(v, encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }
