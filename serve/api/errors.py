"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with its status."""

from __future__ import annotations

from http import HTTPStatus

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
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, HTTPStatus(status).phrase.lower().replace(" ", "_")),
            "param": param,
            "code": code,
        }
    }


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(error.status, error.message, error.param, error.code), status_code=error.status
    )
