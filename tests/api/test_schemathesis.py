"""Fuzz every operation of a live server's /openapi.json with schemathesis: no response
is a 5xx, and none hangs.

Bodies come three ways: valid by the schema, invalid by it, and valid with a plain
prompt or conversation. The schema cannot state all the server's rules (a tool message
needs content, token ids are in the vocabulary), so schema-valid bodies are mostly refused before the engine; the third kind
reaches it with generated sampling fields. The server's limits keep what a request can ask for small: a 32-token context
bounds `max_tokens`, --max-n the choices per prompt.
"""

from __future__ import annotations

from typing import Any

import hypothesis
import pytest
import schemathesis
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/ping"),
    ("POST", "/ping"),
    ("GET", "/version"),
    ("GET", "/load"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("GET", "/v1/responses/{response_id}/input_items"),
    ("POST", "/v1/embeddings"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/tokenizer_info"),
]
EXAMPLES_PER_OPERATION = 50
SEED = 9  # the same examples on every run
REQUEST_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def fuzzed_server(server_factory):
    return server_factory("--max-model-len", "32", "--max-n", "4")


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")


def test_every_operation_is_fuzzed(api_schema):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert sorted((op.method.upper(), op.path) for op in operations) == sorted(OPERATIONS)


def _with_a_plain_prompt(model: str):
    def steer(case: Any) -> Any:
        body = case.body
        if isinstance(body, dict):
            if isinstance(body.get("model"), str):
                body["model"] = model
            if "prompt" in body and not (isinstance(body["prompt"], str) and body["prompt"]):
                body["prompt"] = "Hello!"
            if "input" in body and not (isinstance(body["input"], str) and body["input"]):
                body["input"] = "Hello!"
            if isinstance(body.get("messages"), list):
                first = body["messages"][0] if body["messages"] else None
                text = first.get("content") if isinstance(first, dict) else None
                content = text if isinstance(text, str) else "Hello!"
                body["messages"] = [{"role": "user", "content": content}]
        return case

    return steer


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[" ".join(op) for op in OPERATIONS])
def test_no_server_errors(api_schema, fuzzed_server, method, path):
    operation = api_schema[path][method]
    steer = _with_a_plain_prompt(fuzzed_server.model)
    cases = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
        operation.as_strategy(GenerationMode.POSITIVE).map(steer),
    )

    @hypothesis.seed(SEED)
    @hypothesis.settings(
        max_examples=EXAMPLES_PER_OPERATION,
        database=None,
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(case=cases)
    def no_5xx(case: Any) -> None:
        response = case.call(timeout=REQUEST_TIMEOUT_S)
        assert response.status_code < 500, f"{case.as_curl_command()}\n-> {response.text[:1000]}"

    no_5xx()
