"""Structured output's request side: `StructuredOutputsParams` (vLLM's, one constraint a
request) and which JSON schemas xgrammar would not hold output to (`unenforceable_json_schema`),
checked where a request is built, without importing xgrammar (the grammar engine itself
lives in serve/worker/structured_output.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar; exactly one of the constraints is set.

    `json`: a JSON schema (dict or its text); `json_object`: any JSON object; `regex`;
    `choice`: one of these strings, verbatim; `grammar`: EBNF in xgrammar's (GBNF-like)
    dialect, with a `root` rule. A schema that uses a keyword the grammar engine would
    ignore is refused (`unenforceable_json_schema`).

    vLLM's options are accepted as they hold here: JSON is always laid out as json.dumps
    writes it on one line, with no other whitespace (`disable_any_whitespace` true, which
    is also what false gets), and an object holds only the properties its schema allows
    (`disable_additional_properties` true; false gets the same). vLLM's `structural_tag`
    and `whitespace_pattern` are refused: serve cannot constrain to them.

    `start_after_token_ids` (serve's; the API sets it for a reasoning model, as vLLM's
    engine decides with --reasoning-parser): a token sequence, the reasoning's end (one
    token, `</think>`, or several, GPT-OSS's `<|channel|>final<|message|>`). The output is
    free until it first completes the sequence, all of it in order (a match may begin in
    the prompt's last tokens), and the grammar holds what follows
    (serve/worker/grammar_start.py); empty: it holds the output from the first token.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    start_after_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "start_after_token_ids", tuple(self.start_after_token_ids))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or any(not isinstance(c, str) for c in self.choice):
                raise ValueError("choice must be a non-empty list of strings.")
        kinds = [k for k in _CONSTRAINTS if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(
                "structured output takes exactly one of json, json_object, regex, choice or "
                f"grammar; got {kinds or 'none'}."
            )
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} {REFUSED_OPTIONS[name]}")
        problem = unenforceable_json_schema(self.json) if self.json is not None else None
        if problem is not None:
            raise ValueError(problem)

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(
            k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None
        )


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "structural_tag")  # and json_object
# vLLM's fields that serve cannot honour, and why.
REFUSED_OPTIONS = {
    "structural_tag": "is not supported by this server: constrain the output with json, "
    "json_object, regex, choice or grammar, or its tool calls with tool_choice.",
    "whitespace_pattern": "is not supported by this server: JSON is written as json.dumps "
    'lays it out on one line (", " and ": "), with no other whitespace.',
}

# ---- JSON schema keywords the grammar engine would ignore ----
#
# xgrammar 0.2.8 compiles these without enforcing them: output that breaks them parses and
# ends with finish_reason "stop". A schema using one is refused rather than broken quietly.
# tests/worker/test_structured_output.py shows xgrammar ignoring each, and enforcing what
# is let through (multipleOf on integers, a length or a pattern alone, a type list).

_IGNORED_KEYWORDS = "not if dependentRequired dependentSchemas dependencies contains".split()
# Read only under a `type`, or the object or array type xgrammar infers from the keywords
# in _INFERRED_TYPES.
_TYPED_KEYWORDS = {
    "string": ("minLength", "maxLength", "pattern"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
    "array": ("minItems", "maxItems"),
    "object": ("minProperties", "maxProperties", "patternProperties", "propertyNames"),
}
_INFERRED_TYPES = {
    "object": {"properties", "additionalProperties"},
    "array": {"items", "prefixItems"},
}
# Beside anyOf, oneOf, allOf or $ref, xgrammar reads the combinator alone: these are lost.
_COMBINATORS = ("anyOf", "oneOf", "allOf", "$ref")
_ASSERTIONS = {keyword for keywords in _TYPED_KEYWORDS.values() for keyword in keywords} | set(
    "properties additionalProperties items prefixItems required enum const format multipleOf "
    "uniqueItems unevaluatedProperties unevaluatedItems minContains maxContains".split()
)
# Where subschemas sit: maps of them, lists of them, one of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_VALUES = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems")


def unenforceable_json_schema(schema: dict[str, Any] | str) -> str | None:
    """Why serve cannot hold output to `schema` (a dict, or its text): the first keyword
    the grammar engine would ignore, with where it is (a JSON pointer); None if there is
    none. Text that is not JSON is left for the grammar compiler to report."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return None
    for pointer, subschema, is_property_name in _subschemas(schema, "", False):
        found = _ignored_keyword(subschema, is_property_name)
        if found is not None:
            what, hint = found
            where = f"at {pointer}" if pointer else "at the schema's root"
            return (
                f"The JSON schema's {what} {where} is not supported: xgrammar, which "
                f"constrains the output, does not enforce it, so the output could break the "
                f"schema.{' ' + hint if hint else ''}"
            )
    return None


def _subschemas(schema: Any, pointer: str, is_property_name: bool) -> Iterator[tuple]:
    """(JSON pointer, subschema, whether it describes property names), parents first."""
    if not isinstance(schema, dict):
        return
    yield pointer, schema, is_property_name
    for key, value in schema.items():
        here = f"{pointer}/{_escaped(key)}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, subschema in value.items():
                yield from _subschemas(subschema, f"{here}/{_escaped(name)}", False)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, subschema in enumerate(value):
                yield from _subschemas(subschema, f"{here}/{i}", False)
        elif key in _SCHEMA_VALUES:
            yield from _subschemas(value, here, False)
        elif key == "propertyNames":
            yield from _subschemas(value, here, True)


def _escaped(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")  # RFC 6901


def _ignored_keyword(schema: dict[str, Any], is_property_name: bool) -> tuple[str, str] | None:
    """(the keyword, in words; a hint) for the first keyword of this one schema that the
    grammar would ignore, or None. Its subschemas are checked on their own."""
    types = _types(schema) or ({"string"} if is_property_name else set())
    branches = schema.get("allOf")
    if isinstance(branches, list) and len(branches) > 1:
        return f"`allOf` of {len(branches)} schemas", "Merge them into one schema."
    combinator = next((k for k in _COMBINATORS if k in schema), None)
    if combinator is not None:
        lost = [k for k in schema if k in _ASSERTIONS]
        if "type" in schema and not _branches_within(schema, combinator, types):
            lost.insert(0, "type")
        if lost:
            target = "the schema it names" if combinator == "$ref" else f"each {combinator} schema"
            return f"`{lost[0]}` beside `{combinator}`", f"Move it into {target}."
    keyword = next((k for k in _IGNORED_KEYWORDS if k in schema), None)
    if keyword is not None:
        return f"`{keyword}`", ""
    if schema.get("uniqueItems") is True:
        return "`uniqueItems`", ""
    multiple = schema.get("multipleOf")
    whole = isinstance(multiple, int) or (isinstance(multiple, float) and multiple.is_integer())
    if multiple is not None and (not types or "number" in types or not whole):
        return "`multipleOf`", 'It is enforced as a whole number under "type": "integer".'
    bound = next((k for k in ("minLength", "maxLength") if k in schema), None)
    shape = next((k for k in ("pattern", "format") if k in schema), None)
    if bound and shape and (not types or "string" in types):
        hint = "Write the length into the pattern (e.g. {1,20})." if shape == "pattern" else ""
        return f"`{bound}` beside `{shape}`", hint
    if "pattern" in schema and "format" in schema and (not types or "string" in types):
        return "`pattern` beside `format`", "Keep one of them (the format is what is written)."
    required = schema.get("required")
    if isinstance(required, list) and (not types or "object" in types):
        properties = schema.get("properties")
        undefined = [n for n in required if not isinstance(properties, dict) or n not in properties]
        if undefined:
            return (
                f"`required` {undefined[0]!r}, which is not in `properties`,",
                "Define it under properties: no other property is written.",
            )
    if "propertyNames" in schema and "properties" in schema:
        return "`propertyNames` beside `properties`", ""
    if not types and not any(k in schema for k in ("enum", "const")):
        inferred = next((t for t, hints in _INFERRED_TYPES.items() if hints & schema.keys()), "")
        for kind, keywords in _TYPED_KEYWORDS.items():
            keyword = next((k for k in keywords if k in schema and kind != inferred), None)
            if keyword is not None:
                return f"`{keyword}` in a schema without `type`", f'Add "type": "{kind}".'
    return None


def _types(schema: dict[str, Any]) -> set[str]:
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    return {t for t in declared if isinstance(t, str)} if isinstance(declared, list) else set()


def _branches_within(schema: dict[str, Any], combinator: str, types: set[str]) -> bool:
    """A `type` beside a combinator is lost, which is harmless where each branch has a type
    within it (or is a $ref, an enum or a const: typed where they are written)."""
    if combinator == "$ref":
        return True
    return all(
        isinstance(branch, dict)
        and (
            any(k in branch for k in ("$ref", "enum", "const"))
            or bool(_typed_as(branch) and _typed_as(branch) <= types)
        )
        for branch in schema.get(combinator) or []
    )


def _typed_as(schema: dict[str, Any]) -> set[str]:
    """The types a schema holds its values to: declared, or as xgrammar infers them (an
    object from `properties`, an array from `items`)."""
    declared = _types(schema)
    if declared:
        return declared
    return {kind for kind, hints in _INFERRED_TYPES.items() if hints & schema.keys()}
