"""POST /v1/embeddings through the official openai client and plain HTTP: vectors equal
HF's final hidden states pooled the same way (float32, 1e-5), floats and base64 alike,
texts and token ids alike, in input order, whole or prefilled in chunks; a
sentence-transformers model's mean pooling and Matryoshka `dimensions`; generation beside
them unchanged; the 4xx of bad input; usage, metrics and the API key."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from api.conftest import scrape_metrics, start_server, stop_process
from api.openai_errors import assert_openai_error
from tiny_models import hf_embedding, random_prompts, write_sentence_transformers_config

ATOL = 1e-5
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Hello!",
]
EMBEDDINGS = "/v1/embeddings"
TOO_LONG = [3 + i % 500 for i in range(513)]  # token ids; the tiny llama's window is 512


def _assert_close(got, expected: torch.Tensor, what: str = "") -> None:
    got_t = torch.tensor(list(got), dtype=torch.float32)
    assert got_t.shape == expected.shape, what
    diff = (got_t - expected).abs().max().item()
    assert diff <= ATOL, f"{what}: differs from HF by {diff:.2e}"


def _decode_base64(data: str) -> list[float]:
    return np.frombuffer(base64.b64decode(data), dtype="<f4").tolist()


def test_float_and_base64_are_the_same_vectors_and_equal_hf(
    client, server, http, tokenizer, tiny_llama
):
    # The SDK asks for base64 itself when no format is given, and decodes it.
    sdk = client.embeddings.create(model=server.model, input=TEXTS)
    floats = client.embeddings.create(model=server.model, input=TEXTS, encoding_format="float")
    body = {"model": server.model, "input": TEXTS, "encoding_format": "base64"}
    raw = http.post(EMBEDDINGS, json=body).json()
    assert raw["object"] == "list" and raw["model"] == server.model
    assert [d["object"] for d in raw["data"]] == ["embedding"] * len(TEXTS)
    for i, text in enumerate(TEXTS):
        expected = hf_embedding(tiny_llama, tokenizer(text).input_ids, "last")
        _assert_close(floats.data[i].embedding, expected, f"text {i}, float")
        assert isinstance(raw["data"][i]["embedding"], str)
        decoded = _decode_base64(raw["data"][i]["embedding"])
        # Three requests, batched differently: equal up to float32 round-off.
        _assert_close(decoded, torch.tensor(floats.data[i].embedding), f"text {i}, base64")
        _assert_close(sdk.data[i].embedding, torch.tensor(decoded), f"text {i}, the SDK's")
        assert np.linalg.norm(decoded) == pytest.approx(1.0, abs=1e-5)  # L2-normalised


def test_a_list_keeps_its_order_and_usage_counts_every_token(client, server, tokenizer):
    together = client.embeddings.create(model=server.model, input=TEXTS, encoding_format="float")
    assert [d.index for d in together.data] == list(range(len(TEXTS)))
    num_tokens = 0
    for i, text in enumerate(TEXTS):
        alone = client.embeddings.create(model=server.model, input=text, encoding_format="float")
        assert len(alone.data) == 1 and alone.data[0].index == 0
        _assert_close(together.data[i].embedding, torch.tensor(alone.data[0].embedding), f"{i}")
        assert alone.usage.prompt_tokens == len(tokenizer(text).input_ids)
        num_tokens += alone.usage.prompt_tokens
    assert together.usage.prompt_tokens == together.usage.total_tokens == num_tokens


def test_token_ids_give_the_texts_vectors(client, server, tokenizer):
    ids = [tokenizer(text).input_ids for text in TEXTS]
    by_text = client.embeddings.create(model=server.model, input=TEXTS, encoding_format="float")
    by_ids = client.embeddings.create(model=server.model, input=ids, encoding_format="float")
    (one,) = client.embeddings.create(
        model=server.model, input=ids[1], encoding_format="float"
    ).data
    for a, b in zip(by_text.data, by_ids.data, strict=True):
        _assert_close(a.embedding, torch.tensor(b.embedding))
    _assert_close(one.embedding, torch.tensor(by_text.data[1].embedding))
    assert by_ids.usage.prompt_tokens == sum(len(i) for i in ids)


def test_a_prompt_prefilled_in_chunks_equals_hf(server_factory, long_context_model):
    """700 tokens on a CPU server (a step holds 512): the last chunk's last row."""
    server = server_factory("--max-model-len", "4096", model=long_context_model)
    (prompt,) = random_prompts(512, 1, 700, 700, seed=91)
    resp = server.client().embeddings.create(
        model=server.model, input=prompt, encoding_format="float"
    )
    _assert_close(resp.data[0].embedding, hf_embedding(long_context_model, prompt, "last"))
    assert resp.usage.prompt_tokens == 700


@pytest.fixture(scope="module")
def st_server(tiny_model_factory, tmp_path_factory):
    """A sentence-transformers model (mean pooling, Normalize, Matryoshka) on a server
    whose steps hold 16 tokens: prompts are prefilled in chunks. Stopped with the module."""
    model_dir = write_sentence_transformers_config(
        tiny_model_factory("llama", is_matryoshka=True), "mean_tokens", normalize=True
    )
    server = start_server(
        model_dir, ("--max-num-batched-tokens", "16"), {}, tmp_path_factory.mktemp("st-logs")
    )
    try:
        yield server, model_dir
    finally:
        stop_process(server.process)


def test_sentence_transformers_mean_pooling_in_chunks_equals_hf(st_server, tokenizer):
    server, model_dir = st_server
    long_text = " ".join(TEXTS * 3)
    inputs = [long_text, *TEXTS]
    resp = server.client().embeddings.create(
        model=server.model, input=inputs, encoding_format="float"
    )
    for i, text in enumerate(inputs):
        ids = tokenizer(text).input_ids
        _assert_close(resp.data[i].embedding, hf_embedding(model_dir, ids, "mean"), f"input {i}")
    assert len(tokenizer(long_text).input_ids) > 3 * 16  # several chunks


@pytest.mark.parametrize("dimensions", [8, 64])
def test_matryoshka_dimensions_truncate_then_normalise(st_server, tokenizer, dimensions):
    server, model_dir = st_server
    resp = server.client().embeddings.create(
        model=server.model, input=TEXTS[0], dimensions=dimensions, encoding_format="float"
    )
    expected = hf_embedding(model_dir, tokenizer(TEXTS[0]).input_ids, "mean", dimensions=dimensions)
    _assert_close(resp.data[0].embedding, expected)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"input": "Hi", "dimensions": 65}  # more than the hidden size
        assert_openai_error(http.post(EMBEDDINGS, json=body), 400, "dimensions")


def test_dimensions_on_a_model_without_matryoshka_is_400(client, server, http):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=server.model, input="Hi", dimensions=16)
    assert e.value.body["param"] == "dimensions" and "Matryoshka" in e.value.body["message"]
    _assert_serving(http, server)


def _assert_serving(http: httpx.Client, server) -> None:
    ok = http.post(EMBEDDINGS, json={"model": server.model, "input": "Hi"})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["data"][0]["embedding"]) == 64


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ""}, 400, "input"),  # OpenAI: "cannot be an empty string"
        ({"input": []}, 400, "input"),
        ({"input": [""]}, 400, "input"),
        ({"input": [[]]}, 400, "input"),
        ({"input": [10**6]}, 400, "input"),
        ({"input": [[3, 4], [-1]]}, 400, "input"),
        ({"input": ["a", 1]}, 400, None),
        ({"input": 5}, 400, "input"),
        ({"input": ["x"] * 2049}, 400, "input"),
        ({"input": TOO_LONG}, 400, "input"),  # max_model_len is 512
        ({"input": "x " * 10**6}, 400, "input"),  # refused before it is tokenized
        ({"input": "Hi", "encoding_format": "hex"}, 400, "encoding_format"),
        (
            {"input": "Hi", "encoding_format": "base64", "embed_dtype": "float64"},
            400,
            "embed_dtype",
        ),
        ({"input": "Hi", "embed_dtype": "int8"}, 400, "embed_dtype"),
        ({"input": "Hi", "encoding_format": "base64", "endianness": "middle"}, 400, "endianness"),
        ({"input": "Hi", "dimensions": 0}, 400, "dimensions"),
        ({"input": "Hi", "priority": 1}, 400, "priority"),
        ({"input": "Hi", "model": "gpt-4"}, 404, "model"),
        ({}, 400, "input"),
    ],
)
def test_bad_input_is_4xx_and_the_server_serves_on(http, server, body, status, param):
    refused = http.post(EMBEDDINGS, json={"model": server.model, **body})
    assert_openai_error(refused, status, param)
    _assert_serving(http, server)


def test_too_long_says_the_numbers_and_the_window_itself_fits(http, server):
    error = assert_openai_error(http.post(EMBEDDINGS, json={"input": TOO_LONG}), 400, "input")
    assert error["code"] == "context_length_exceeded"
    assert "512" in error["message"] and "513" in error["message"]
    # An embedding needs no room for output: a prompt as long as the window fits.
    full = http.post(EMBEDDINGS, json={"input": TOO_LONG[:512]})
    assert full.status_code == 200 and full.json()["usage"]["prompt_tokens"] == 512


def test_generation_beside_embeddings_is_unchanged(server):
    body = {"model": server.model, "prompt": TEXTS[0], "max_tokens": 24, "temperature": 0}
    body["ignore_eos"] = True
    long_inputs = random_prompts(512, 8, 40, 120, seed=92)

    async def together():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            responses = await asyncio.gather(
                http.post("/v1/completions", json=body),
                *(http.post(EMBEDDINGS, json={"input": ids}) for ids in long_inputs),
            )
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        return responses[0].json()["choices"][0]["text"]

    with httpx.Client(base_url=server.url, timeout=60) as http:
        alone = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert asyncio.run(together()) == alone


def test_metrics_count_embedding_requests(http, server):
    before = scrape_metrics(server)
    resp = http.post(EMBEDDINGS, json={"input": TEXTS})
    assert resp.status_code == 200
    after = scrape_metrics(server)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew('serve_request_success_total{finished_reason="stop"}') == len(TEXTS)
    assert grew("serve_prompt_tokens_total") == resp.json()["usage"]["prompt_tokens"]
    assert grew('serve_http_responses_total{status="200"}') >= 1


def test_embeddings_need_the_api_key(server_factory):
    server = server_factory("--api-key", "secret", "--served-model-name", "tiny")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert_openai_error(http.post(EMBEDDINGS, json={"input": "Hi"}), 401)
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").embeddings.create(model="tiny", input="Hi")
    resp = server.client(api_key="secret").embeddings.create(model="tiny", input="Hi")
    assert resp.model == "tiny" and len(resp.data[0].embedding) == 64
