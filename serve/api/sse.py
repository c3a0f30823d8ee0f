"""Server-sent events as every streamed endpoint frames them: one JSON data line per
event, no character in it that any client reads as a line end, and the chunk envelope
(id, created, model; usage when asked) of chat and completions streams.

Events are UTF-8 bytes, encoded by msgspec: a streamed token costs one event, and a
completion chunk took 6-8.6 us through `json.dumps` and `str.encode`, 1.5-1.6 us here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from serve.api.protocol import now

_encode = msgspec.json.Encoder().encode
# Python's str.splitlines, and so httpx's `aiter_lines`, also ends a line at U+0085, U+2028
# and U+2029, which JSON leaves raw inside strings; escaped, a token's text cannot cut an
# event in two for such a client. (Lower control characters the encoder escapes itself.)
_LINE_BREAKS_KEPT_RAW = (
    ("\x85".encode(), b"\\u0085"),
    ("\u2028".encode(), b"\\u2028"),
    ("\u2029".encode(), b"\\u2029"),
)


def sse_json(payload: dict[str, Any]) -> bytes:
    """`payload` as one SSE data line: no character in it ends a line for any client. A
    float that JSON cannot hold (NaN, infinity) is null."""
    data = _encode(payload)
    for raw, escaped in _LINE_BREAKS_KEPT_RAW:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def sse(payload: dict[str, Any], event: str | None = None) -> bytes:
    named = b"event: " + event.encode() + b"\n" if event else b""
    return named + b"data: " + sse_json(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class ChunkWriter:
    """Frames one streamed response's chunks: the same id, created time and model on each.
    With `continuous_usage` (vLLM's `continuous_usage_stats`) each chunk carries its
    choice's usage so far: its prompt's tokens (`num_prompt_tokens`, per prompt, `n`
    choices each) and the tokens it has sent."""

    id: str
    object: str
    model: str
    include_usage: bool
    continuous_usage: bool = False
    num_prompt_tokens: tuple[int, ...] = ()
    n: int = 1
    created: int = field(default_factory=now)
    # vLLM's `return_token_ids`: set (each prompt's ids), every chunk of a choice carries
    # the token ids it took since its previous chunk (`add_token_ids`), and each choice's
    # first chunk its prompt's ids: in the choice, or with `prompt_ids_on_top` (chat's)
    # beside the choices.
    prompt_token_ids: tuple[list[int], ...] | None = None
    prompt_ids_on_top: bool = False
    _pending: dict[int, list[int]] = field(default_factory=dict)
    _started: set[int] = field(default_factory=set)

    def add_token_ids(self, index: int, token_ids: list[int]) -> None:
        if self.prompt_token_ids is not None:
            self._pending.setdefault(index, []).extend(token_ids)

    def chunk(self, index: int, num_completion_tokens: int = 0, **choice: Any) -> bytes:
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, **choice}],
        }
        if self.prompt_token_ids is not None:
            self._with_token_ids(body, index)
        if self.continuous_usage:
            prompt = self.num_prompt_tokens[index // self.n]
            body["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": num_completion_tokens,
                "total_tokens": prompt + num_completion_tokens,
            }
        elif self.include_usage:
            body["usage"] = None  # OpenAI sends the key on every chunk, null until the last
        return sse(body)

    def _with_token_ids(self, body: dict[str, Any], index: int) -> None:
        assert self.prompt_token_ids is not None
        (choice,) = body["choices"]
        choice["token_ids"] = self._pending.pop(index, [])
        if index in self._started:
            return
        prompt_ids = self.prompt_token_ids[index // self.n]
        (body if self.prompt_ids_on_top else choice)["prompt_token_ids"] = prompt_ids
        self._started.add(index)

    def usage_chunk(self, counts: dict[str, int]) -> bytes:
        body = {"id": self.id, "object": self.object, "created": self.created}
        return sse({**body, "model": self.model, "choices": [], "usage": counts})
