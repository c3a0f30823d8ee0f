"""Request bodies as JSON, checked before FastAPI validates them against a model.

FastAPI alone answers a body of another content type, or one that is not a JSON object,
with pydantic's "Input should be a valid dictionary", and lets lone UTF-16 surrogates
through (`"\\ud800"` is a valid JSON escape, but no UTF-8 text can hold it), which the
tokenizer then raises on. Here, for every route that takes a body:

- a Content-Type that is not JSON gets 415; a missing one is read as JSON;
- a body that is not UTF-8 JSON, or not an object, or nests deeper than
  MAX_NESTING_DEPTH, gets 400 saying so;
- a string (or object key) with a lone surrogate gets 400 naming its field.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from serve.api.errors import APIError

# A decoded UTF-8 text holds no surrogates, so a parsed body can only get them from the
# escapes \ud800-\udfff: bodies without such an escape need no walk.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
# Deeper bodies (a JSON schema nested hundreds of levels) overflow the recursion of the
# code that handles them, such as pickling a request for the engine process. OpenAI's
# structured outputs allow schemas 10 levels deep.
MAX_NESTING_DEPTH = 64
_TOO_DEEP = f"The request body nests more than {MAX_NESTING_DEPTH} arrays and objects deep."

JSONPath = list[str | int]


def is_json_content_type(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


def decode_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or an APIError (400) that says what is wrong with it."""
    if not body.strip():
        raise APIError(400, "The request body is empty; send a JSON object.")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"The request body is not valid UTF-8 (at byte {e.start}).") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(
            400, f"The request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})."
        ) from None
    except ValueError:  # json.loads's one other error: an integer too long to convert
        raise APIError(
            400,
            f"The request body holds an integer of more than {sys.get_int_max_str_digits()} "
            "digits.",
        ) from None
    except RecursionError:
        raise APIError(400, _TOO_DEEP) from None
    if not isinstance(value, dict):
        raise APIError(400, f"The request body must be a JSON object, not {_json_kind(value)}.")
    if _nesting_depth(value) > MAX_NESTING_DEPTH:
        raise APIError(400, _TOO_DEEP)
    path = _lone_surrogate_path(value) if _SURROGATE_ESCAPE.search(text) else None
    if path is not None:
        # The key itself may hold the surrogate: escaped, as a response cannot hold it either.
        param = ".".join(str(step) for step in path).encode("utf-8", "backslashreplace").decode()
        raise APIError(
            400,
            f"{param}: text must not contain lone UTF-16 surrogates (\\ud800-\\udfff not "
            "part of a pair), which no UTF-8 text can hold.",
            param=param,
        )
    return value


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {list: "an array", str: "a string"}.get(type(value), "a number")


def _nesting_depth(value: dict[str, Any]) -> int:
    """How many objects and arrays deep `value` goes, counted a level at a time; stops
    counting past MAX_NESTING_DEPTH."""
    depth, level = 0, [value]
    while level and depth <= MAX_NESTING_DEPTH:
        depth += 1
        level = [
            child
            for item in level
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, (dict, list))
        ]
    return depth


def _lone_surrogate_path(value: Any) -> JSONPath | None:
    """The path to a string, or an object key, holding a lone surrogate; None if none does.
    Iterative, as a body may nest as deep as the JSON parser allows."""
    pending: list[tuple[JSONPath, Any]] = [([], value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                if _SURROGATE.search(key):
                    return [*path, key]
                pending.append(([*path, key], child))
        elif isinstance(item, list):
            pending.extend(([*path, i], child) for i, child in enumerate(item))
    return None


class JSONBodyRequest(Request):
    """A request whose `json()` is `decode_json_object` of its body."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = decode_json_object(await self.body())
        return self._json


class JSONBodyRoute(APIRoute):
    """A route whose body, if it takes one, is checked here before FastAPI reads it.
    FastAPI turns any error it meets while reading a body into a bare 400, so the checks
    run first, where an APIError reaches the app's handler."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def checked_handler(request: Request) -> Response:
            request = JSONBodyRequest(request.scope, request.receive)
            content_type = request.headers.get("content-type")
            if content_type and not is_json_content_type(content_type):
                raise APIError(
                    415,
                    f"Unsupported Content-Type {content_type!r}: send the body as JSON, "
                    "with 'Content-Type: application/json'.",
                )
            await request.json()  # parsed and checked once; FastAPI reads the cached value
            return await handler(request)

        return checked_handler
