"""Structured-output requests on the tiny model: vLLM's `structured_outputs` field holds
the output to its constraint on chat and completions (the tiny model writes free text
otherwise), and what serve cannot enforce is a 400 naming the field, never output that
breaks its schema."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from api.openai_errors import assert_openai_error

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "ok"],
}
UNIQUE_TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
}


def body(server, path: str, **fields) -> dict:
    if path == CHAT:
        return {"model": server.model, "messages": [{"role": "user", "content": "hi"}], **fields}
    return {"model": server.model, "prompt": "hi", **fields}


def texts(response, path: str) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice."""
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    key = "text" if path == COMPLETIONS else None
    return [(c[key] if key else c["message"]["content"], c["finish_reason"]) for c in choices]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_structured_outputs_hold_the_output(http, server, path):
    def ask(constraint: dict, max_tokens: int = 40) -> list[tuple[str, str]]:
        fields = {"structured_outputs": constraint, "n": 3, "seed": 1, "temperature": 1.0}
        return texts(
            http.post(path, json=body(server, path, max_tokens=max_tokens, **fields)), path
        )

    assert {text for text, _ in ask({"choice": ["yes", "no"]})} <= {"yes", "no"}
    for text, _ in ask({"regex": "[a-c]{3}"}):
        assert re.fullmatch("[a-c]{3}", text), text
    for text, _ in ask({"grammar": 'root ::= ("x" | "y") ("0" | "1")'}):
        assert re.fullmatch("[xy][01]", text), text
    for text, reason in ask({"json": SCHEMA, "disable_any_whitespace": True}):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
        assert text == json.dumps(json.loads(text))  # one line, as json.dumps lays it out
    for text, _ in ask({"json": json.dumps(SCHEMA)}):  # a schema as text
        jsonschema.validate(json.loads(text), SCHEMA)
    for text, reason in ask({"json_object": True}, max_tokens=80):
        assert text.startswith("{"), text
        assert reason == "length" or isinstance(json.loads(text), dict)


def test_structured_outputs_hold_a_streamed_chat(client, server):
    stream = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=40,
        stream=True,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("yes", "no")


def test_structured_outputs_hold_a_response(http, server):
    """The Responses API passes vLLM's extra on to the chat request it runs."""
    fields = {"input": "hi", "max_output_tokens": 40, "structured_outputs": {"regex": "[a-c]{3}"}}
    reply = http.post("/v1/responses", json={"model": server.model, **fields})
    assert reply.status_code == 200, reply.text
    assert re.fullmatch("[a-c]{3}", reply.json()["output"][0]["content"][0]["text"])


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {"structured_outputs": {"structural_tag": '{"type": "structural_tag"}'}},
            "structured_outputs.structural_tag",
            ["not supported"],
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "[ ]?"}},
            "structured_outputs.whitespace_pattern",
            ["not supported", "one line"],
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            ["exactly one", "regex and choice"],
        ),
        ({"structured_outputs": {}}, "structured_outputs", ["exactly one", "none"]),
        ({"structured_outputs": {"choices": ["a"]}}, "structured_outputs", ["'choices'"]),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", ["non-empty"]),
        (
            {"structured_outputs": {"json": UNIQUE_TAGS}},
            "structured_outputs.json",
            ["`uniqueItems` at /properties/tags", "xgrammar"],
        ),
        (
            {"guided_json": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}},
            "guided_json",
            ["`maxLength` beside `pattern` at the schema's root"],
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}
                        | {"required": ["a", "b"], "additionalProperties": False},
                    },
                }
            },
            "response_format",
            ["`required` 'b'"],
        ),
        ({"guided_choice": []}, "guided_choice", ["non-empty"]),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", ["guided_regex"]),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            ["at most one", "response_format"],
        ),
    ],
    ids=[
        "structural-tag",
        "whitespace-pattern",
        "two-constraints",
        "no-constraint",
        "unknown-key",
        "empty-choice",
        "unique-items",
        "pattern-and-length",
        "required-not-a-property",
        "guided-empty-choice",
        "two-guided",
        "response-format-and-structured-outputs",
    ],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_what_serve_cannot_enforce_is_a_400(http, server, path, fields, param, words):
    refused = http.post(path, json=body(server, path, max_tokens=4, **fields))
    error = assert_openai_error(refused, 400, param)
    assert error["param"] == param  # named, never null
    assert error["message"].startswith(f"{param}: ")
    for word in words:
        assert word in error["message"], error
