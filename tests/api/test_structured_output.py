"""Structured output on the default model, through the openai client: every sampled
completion follows its JSON schema, JSON object, regex or choice."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "address", "tags"],
}


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(model=None)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def ask(client, server, content: str, **kwargs):
    return client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": content}], **kwargs
    )


def test_json_schema_twenty_seeded_samples_validate(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    texts = []
    for seed in range(0, 20, 5):  # sample i of each request is seeded seed + i
        resp = ask(
            client,
            server,
            "Describe a user of our website as JSON.",
            n=5,
            seed=seed,
            temperature=1.0,
            max_tokens=160,
            response_format=fmt,
        )
        assert all(c.finish_reason == "stop" for c in resp.choices)
        texts += [c.message.content for c in resp.choices]
    assert len(set(texts)) > 10  # sampled, not one answer twenty times
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_always_parses(client, server):
    resp = ask(
        client,
        server,
        "Give me a JSON object about cats.",
        n=4,
        seed=3,
        max_tokens=120,
        response_format={"type": "json_object"},
    )
    for choice in resp.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut off by max_tokens: still a prefix of an object
            assert choice.message.content.startswith("{")
    assert any(c.finish_reason == "stop" for c in resp.choices)


def test_regex_and_choice_always_match(client, server):
    pattern = r"\d{3}-\d{3}-\d{4}"
    resp = ask(
        client,
        server,
        "What is your phone number?",
        n=5,
        seed=1,
        extra_body={"guided_regex": pattern},
    )
    for choice in resp.choices:
        assert re.fullmatch(pattern, choice.message.content)
    options = ["positive", "negative", "neutral"]
    resp = ask(
        client,
        server,
        "Sentiment of 'I love this movie!'?",
        n=5,
        seed=2,
        extra_body={"guided_choice": options},
    )
    assert {c.message.content for c in resp.choices} <= set(options)


def test_completions_accept_response_format(server):
    import httpx

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {
        "model": server.model,
        "prompt": "A number as JSON:",
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    }
    choice = httpx.post(f"{server.v1}/completions", json=body, timeout=60).json()["choices"][0]
    jsonschema.validate(json.loads(choice["text"]), schema)
