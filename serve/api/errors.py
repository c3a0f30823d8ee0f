"""Error bodies in the shape of the API a path speaks, with their HTTP status.

OpenAI's, `{"error": {"message", "type", "param", "code"}}`, everywhere but Anthropic's
Messages paths, which get Anthropic's `{"type": "error", "error": {"type", "message"}}`.
Every place that answers an error (route handlers, auth, admission, the last-resort
handler) builds its body here from the request's path, so a client of either API reads
errors its SDK understands, whichever layer refused the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
# Anthropic's error types by status (docs.anthropic.com/en/api/errors): other 4xx are
# invalid requests, other 5xx api errors; a server at capacity is "overloaded".
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"  # and everything under it (count_tokens, and unknown routes)


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    path: str = "",
) -> dict[str, Any]:
    """The error body for a request to `path` (Anthropic's shape on its paths)."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return anthropic_error_body(status, message)
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, HTTPStatus(status).phrase.lower().replace(" ", "_")),
            "param": param,
            "code": code,
        }
    }


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    default = "invalid_request_error" if status < 500 else "api_error"
    return {
        "type": "error",
        "error": {"type": _ANTHROPIC_TYPES.get(status, default), "message": message},
    }


# Statuses a client's retry would only repeat: the OpenAI and Anthropic SDKs retry 5xx
# (twice by default) unless told not to. A --request-timeout 504 would run the whole
# request again, twice, and end in the same 504.
_NOT_RETRIED = {504}


def error_response(error: APIError, path: str = "") -> JSONResponse:
    body = error_body(error.status, error.message, error.param, error.code, path)
    headers = {"x-should-retry": "false"} if error.status in _NOT_RETRIED else None
    return JSONResponse(body, status_code=error.status, headers=headers)


def validation_message(errors: Sequence[Any], body: Any) -> tuple[str, str | None]:
    """The message and `param` for pydantic's errors about a request `body`: the error
    about the deepest field (for a union field, the member that matched furthest), its
    message prefixed with the field's dotted path."""
    if not errors:
        return "Invalid request.", None
    located = [(_field_path(error, body), error) for error in errors]
    path, error = max(located, key=lambda pair: len(pair[0]))  # the first among equals
    param = ".".join(str(step) for step in path) or None
    message = error.get("msg", "invalid value").removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


def _field_path(error: Any, body: Any) -> list[str | int]:
    """The error's location in the body, without the steps pydantic adds that the body
    does not have: the member of a union it tried (`content.str`,
    `tool_choice.NamedToolChoice`). A missing field, the last step, is kept."""
    steps = [step for step in error.get("loc", ()) if step != "body"]
    path: list[str | int] = []
    value = body
    for i, step in enumerate(steps):
        if isinstance(value, dict) and step in value:
            value = value[step]
        elif isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            value = value[step]
        elif not (i == len(steps) - 1 and error.get("type") == "missing"):
            continue
        path.append(step)
    return path
