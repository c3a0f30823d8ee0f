"""Checks that an HTTP response is an error in exactly OpenAI's shape."""

from __future__ import annotations

import httpx


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    """The status, and exactly OpenAI's body: no FastAPI `{"detail": ...}`."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error
