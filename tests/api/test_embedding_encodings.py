"""POST /v1/embeddings' vLLM encodings: base64 and "bytes"/"bytes_only" bodies written in
`embed_dtype` (float32, float16, bfloat16, fp8_e4m3, fp8_e5m2) and `endianness` (native,
big, little), decoded here with numpy as vLLM's example client decodes them, equal to the
float response of the same input to the dtype's precision; "float" ignores both fields.
The 400s of unknown values are in test_embeddings.py."""

from __future__ import annotations

import base64
import json
import sys

import numpy as np
import torch

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello!"]
EMBEDDINGS = "/v1/embeddings"
DTYPES = ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
ENDIANNESS = ["native", "big", "little"]
NUMPY_BYTE_ORDER = {"native": "=", "big": ">", "little": "<"}
# embed_dtype -> (bytes a value, mantissa bits, the smallest subnormal)
DTYPE_INFO = {
    "float32": (4, 23, 2.0**-149),
    "float16": (2, 10, 2.0**-24),
    "bfloat16": (2, 7, 2.0**-133),
    "fp8_e4m3": (1, 3, 2.0**-9),
    "fp8_e5m2": (1, 2, 2.0**-16),
}
FLOAT_SLACK = 1e-5  # two requests of one input may differ by float32 round-off (prefix cache)


def decode(raw: bytes, embed_dtype: str, endianness: str) -> np.ndarray:
    """The float32 values of `raw`, as a client reading `embed_dtype` in that byte order."""
    order = NUMPY_BYTE_ORDER[endianness]
    if embed_dtype == "float32":
        return np.frombuffer(raw, dtype=f"{order}f4").astype(np.float32)
    if embed_dtype == "float16":
        return np.frombuffer(raw, dtype=f"{order}f2").astype(np.float32)
    if embed_dtype == "bfloat16":  # the top half of a float32
        top = np.frombuffer(raw, dtype=f"{order}u2").astype(np.uint32)
        return (top << 16).view(np.float32)
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[embed_dtype]
    bits = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())  # numpy has no fp8
    return bits.view(fp8).float().numpy()


def assert_within_precision(got: np.ndarray, floats: list[float], embed_dtype: str) -> None:
    """`got` is `floats` rounded to `embed_dtype`: within half a unit in the last place."""
    _, mantissa_bits, subnormal = DTYPE_INFO[embed_dtype]
    expected = np.asarray(floats, dtype=np.float64)
    assert got.shape == expected.shape, embed_dtype
    bound = np.abs(expected) * 2.0 ** -(mantissa_bits + 1) + subnormal / 2 + FLOAT_SLACK
    diff = np.abs(got.astype(np.float64) - expected)
    assert (diff <= bound).all(), f"{embed_dtype}: off by {diff.max():.2e}"


def test_vector_bytes_round_to_nearest_even_in_the_byte_order_asked():
    from serve.api.protocol_embeddings import vector_bytes

    # bfloat16: 1 + 2^-8 is a tie (rounds to even, 1.0); 1 + 3*2^-8 rounds up to 1 + 2^-6.
    vector = [1 + 2**-8, 1 + 3 * 2**-8, -2.0]
    assert vector_bytes(vector, "bfloat16", "big") == bytes.fromhex("3f80 3f82 c000")
    assert vector_bytes(vector, "bfloat16", "little") == bytes.fromhex("803f 823f 00c0")
    assert vector_bytes([1.5, -0.25], "float16", "big") == bytes.fromhex("3e00 b400")
    assert vector_bytes([1.5], "float32", "big") == bytes.fromhex("3fc00000")
    assert vector_bytes([1.5], "float32", "native") == np.float32(1.5).tobytes()
    assert vector_bytes([1.5, -0.25], "fp8_e4m3", "big") == bytes.fromhex("3c a8")
    assert vector_bytes([1.5, -0.25], "fp8_e5m2", "little") == bytes.fromhex("3e b4")
    native = "big" if sys.byteorder == "big" else "little"
    assert vector_bytes(vector, "bfloat16", "native") == vector_bytes(vector, "bfloat16", native)


def test_base64_is_written_in_embed_dtype_and_endianness(http, server):
    """What vLLM's embedding_embed_dtype_client.py asks for and decodes, each dtype and
    byte order; "float" with the same fields is the plain float vector (vLLM ignores them)."""
    body = {"model": server.model, "input": TEXTS[0]}
    floats = http.post(EMBEDDINGS, json={**body, "encoding_format": "float"}).json()
    (vector,) = [d["embedding"] for d in floats["data"]]
    for embed_dtype in DTYPES:
        for endianness in ENDIANNESS:
            fields = {"embed_dtype": embed_dtype, "endianness": endianness}
            resp = http.post(EMBEDDINGS, json={**body, "encoding_format": "base64", **fields})
            assert resp.status_code == 200, resp.text
            raw = base64.b64decode(resp.json()["data"][0]["embedding"])
            assert len(raw) == len(vector) * DTYPE_INFO[embed_dtype][0], fields
            assert_within_precision(decode(raw, embed_dtype, endianness), vector, embed_dtype)
            as_floats = http.post(EMBEDDINGS, json={**body, "encoding_format": "float", **fields})
            got = np.asarray(as_floats.json()["data"][0]["embedding"])
            assert np.abs(got - vector).max() <= FLOAT_SLACK, fields


def test_bytes_body_holds_every_vector_and_the_metadata_header_says_where(http, server):
    body = {"model": server.model, "input": TEXTS}
    floats = http.post(EMBEDDINGS, json={**body, "encoding_format": "float"}).json()
    vectors = [d["embedding"] for d in floats["data"]]
    fields = {"embed_dtype": "bfloat16", "endianness": "big"}
    resp = http.post(EMBEDDINGS, json={**body, "encoding_format": "bytes", **fields})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/octet-stream"
    metadata = json.loads(resp.headers["metadata"])
    assert metadata["id"].startswith("embd") and isinstance(metadata["created"], int)
    assert metadata["model"] == server.model and metadata["usage"] == floats["usage"]
    offset = 0
    for i, (item, vector) in enumerate(zip(metadata["data"], vectors, strict=True)):
        assert item["index"] == i and item["shape"] == [len(vector)]
        assert item["embed_dtype"] == "bfloat16" and item["endianness"] == "big"
        assert item["start"] == offset and item["end"] == offset + 2 * len(vector)
        got = decode(resp.content[item["start"] : item["end"]], "bfloat16", "big")
        assert_within_precision(got, vector, "bfloat16")
        offset = item["end"]
    assert len(resp.content) == offset

    bare = http.post(EMBEDDINGS, json={**body, "encoding_format": "bytes_only", **fields})
    assert bare.status_code == 200, bare.text
    assert bare.headers["content-type"] == "application/octet-stream"
    assert "metadata" not in bare.headers and len(bare.content) == offset
    got = decode(bare.content, "bfloat16", "big").reshape(len(vectors), -1)
    for row, vector in zip(got, vectors, strict=True):
        assert_within_precision(row, vector, "bfloat16")
