"""POST /v1/embeddings: OpenAI's request and response shapes (pydantic).

OpenAI's rules, checked at the door: `input` is a string, a list of strings, a list of
token ids or a list of such lists, never empty (nor an empty string), at most
MAX_EMBEDDING_INPUTS entries; `dimensions` is positive. Whether the model may be truncated
to `dimensions` is the engine's check.

vLLM's encodings, as its `vllm/utils/serial_utils.py` and `entrypoints/pooling/utils.py`:
`encoding_format` "float" (JSON numbers: the vector as computed, whatever `embed_dtype`
says), "base64" (each vector's bytes in `embed_dtype` and `endianness`, base64 in the
JSON), "bytes" (every vector's bytes, one after another, as the body, the JSON rest in a
`metadata` header) or "bytes_only" (the same body, no header). A vector's bytes: the
float32 vector rounded to `embed_dtype` as torch rounds (to nearest, ties to even), each
value's bits in the byte order `endianness` names ("native": the server's).
"""

from __future__ import annotations

import base64
import sys
from typing import Any, Literal

from pydantic import Field, field_validator

from serve.api.protocol import CLIENT_REQUEST_ID, OpenAIModel, Priority, TruncatePromptTokens

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on the entries of one request's `input`

EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]

# embed_dtype -> (the torch dtype a vector is rounded to, a same-width dtype whose numpy
# array holds its bits: numpy has no bfloat16 nor fp8). vLLM's EMBED_DTYPES.
_TORCH_DTYPES: dict[str, tuple[str, str]] = {
    "float32": ("float32", "float32"),
    "float16": ("float16", "float16"),
    "bfloat16": ("bfloat16", "int16"),
    "fp8_e4m3": ("float8_e4m3fn", "uint8"),
    "fp8_e5m2": ("float8_e5m2", "uint8"),
}


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's: the response's id is `embd-` and this (an X-Request-Id header takes its place).
    request_id: str | None = Field(default=None, pattern=f"^{CLIENT_REQUEST_ID}$")
    # vLLM's extras: how "base64" and "bytes" write each value (the module docstring).
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"
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


def vector_bytes(vector: list[float], embed_dtype: EmbedDType, endianness: Endianness) -> bytes:
    """A float32 vector's bytes in `embed_dtype` and `endianness` (vLLM's tensor2binary).
    The defaults, float32 in the server's byte order, are what the openai SDK decodes."""
    import torch  # loaded by the engine before any request; `import serve.api` need not

    rounded, bits = (getattr(torch, name) for name in _TORCH_DTYPES[embed_dtype])
    array = torch.tensor(vector, dtype=torch.float32).to(rounded).view(bits).numpy()
    if endianness != "native" and endianness != sys.byteorder:
        array = array.byteswap()
    return array.tobytes()


def encode_embedding(vector: list[float], request: EmbeddingRequest) -> list[float] | str:
    """A vector as the JSON response carries it: floats, or base64 of its bytes."""
    if request.encoding_format == "base64":
        raw = vector_bytes(vector, request.embed_dtype, request.endianness)
        return base64.b64encode(raw).decode("ascii")
    return vector


def embedding_response(
    model: str, vectors: list[list[float]], request: EmbeddingRequest, num_prompt_tokens: int
) -> dict[str, Any]:
    """The JSON body, for encoding_format "float" or "base64"."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_embedding(v, request)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": usage(num_prompt_tokens),
    }


def embedding_bytes(
    request_id: str,
    created: int,
    model: str,
    vectors: list[list[float]],
    request: EmbeddingRequest,
    num_prompt_tokens: int,
) -> tuple[bytes, dict[str, Any]]:
    """The body for encoding_format "bytes" (and "bytes_only"): every vector's bytes, one
    after another, and the metadata vLLM sends beside them: where each vector starts and
    ends in the body (byte offsets), its dtype, byte order and shape."""
    chunks, items, offset = [], [], 0
    for i, vector in enumerate(vectors):
        chunk = vector_bytes(vector, request.embed_dtype, request.endianness)
        items.append(
            {
                "index": i,
                "embed_dtype": request.embed_dtype,
                "endianness": request.endianness,
                "start": offset,
                "end": offset + len(chunk),
                "shape": [len(vector)],
            }
        )
        chunks.append(chunk)
        offset += len(chunk)
    metadata = {
        "id": request_id,
        "created": created,
        "model": model,
        "data": items,
        "usage": usage(num_prompt_tokens),
    }
    return b"".join(chunks), metadata


def usage(num_prompt_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}
