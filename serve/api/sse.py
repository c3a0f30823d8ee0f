"""Server-sent events as every streamed endpoint frames them: one JSON data line per
event, no character in it that any client reads as a line end, and the chunk envelope
(id, created, model; usage when asked) of chat and completions streams."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from serve.api.protocol import now

# Python's str.splitlines, and so httpx's `aiter_lines`, also ends a line at U+0085, U+2028
# and U+2029, which json.dumps leaves raw inside strings; escaped, a token's text cannot cut
# an event in two for such a client. (Lower control characters json.dumps escapes itself.)
_LINE_BREAKS_KEPT_RAW = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(payload: dict[str, Any]) -> str:
    """`payload` as one SSE data line: no character in it ends a line for any client."""
    return json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS_KEPT_RAW)


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {sse_json(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ChunkWriter:
    """Frames one streamed response's chunks: the same id, created time and model on each."""

    id: str
    object: str
    model: str
    include_usage: bool
    created: int = field(default_factory=now)

    def chunk(self, index: int, **choice: Any) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, **choice}],
        }
        if self.include_usage:
            body["usage"] = None  # OpenAI sends the key on every chunk, null until the last
        return sse(body)

    def usage_chunk(self, counts: dict[str, int]) -> str:
        body = {"id": self.id, "object": self.object, "created": self.created}
        return sse({**body, "model": self.model, "choices": [], "usage": counts})
