"""The Responses API's stream: typed, numbered SSE events, and the output items that a
streamed choice's pieces (content text and tool-call deltas, as the chat stream readers
give them) build, one item open at a time.

For each item: `response.output_item.added`; a message then has
`response.content_part.added`, `response.output_text.delta`s, `response.output_text.done`
and `response.content_part.done`; a reasoning item (first, with --reasoning-parser) the
same with `response.reasoning_text.delta`s and `.done`, as vLLM streams it; a function
call has `response.function_call_arguments.delta`s and `.done`; then
`response.output_item.done`.
"""

from __future__ import annotations

import copy
from typing import Any

from serve.api.responses_items import (
    function_call_item,
    message_item,
    output_text_part,
    reasoning_item,
    reasoning_text_part,
)
from serve.api.sse import sse
from serve.chat.tool_parsers import StreamEvent

Event = tuple[str, dict[str, Any]]  # (type, fields)


class EventNumbering:
    """Frames one response's events, each with the next `sequence_number`."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def sse(self, type: str, **fields: Any) -> bytes:
        payload = {"type": type, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return sse(payload, event=type)


class StreamedOutput:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # in output order; the last may be open
        self._open: dict[str, Any] | None = None
        # Logprobs of tokens whose text a reader holds back: they go with the next text.
        self._pending_logprobs: list[dict[str, Any]] = []

    def feed(self, pieces: list[StreamEvent], logprobs: list[dict[str, Any]]) -> list[Event]:
        """The events for a choice's next pieces, whose tokens have `logprobs`."""
        self._pending_logprobs += logprobs
        events: list[Event] = []
        for piece in pieces:
            if isinstance(piece, str):
                if piece:
                    events += self._text(piece)
            elif piece.id is not None:  # a call starts
                events += self._close("completed")
                self._pending_logprobs = []  # the call's markup, not text
                item = function_call_item(piece.id, piece.name or "", "", "in_progress")
                events += self._add(item)
                if piece.arguments:
                    events += self._arguments(piece.arguments)
            else:
                events += self._arguments(piece.arguments)
        return events

    def reasoning(self, text: str) -> list[Event]:
        """The events for more of the choice's reasoning (its item opens first)."""
        events = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self._close("completed")
            events += self._add(reasoning_item("", "in_progress"))
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        where = {"item_id": item["id"], "output_index": self._index, "content_index": 0}
        return [*events, ("response.reasoning_text.delta", {**where, "delta": text})]

    def finish(self, status: str) -> list[Event]:
        """Close the open item with `status`; an output with nothing in it is an empty
        message, as the non-streamed response has."""
        events = [] if self.items else self._add(message_item("", "in_progress", []))
        return events + self._close(status)

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        self._open = item
        added = copy.deepcopy(item)
        events: list[Event] = []
        if item["type"] in ("message", "reasoning"):
            is_message = item["type"] == "message"
            added["content"] = [] if is_message else None  # vLLM's reasoning item: none yet
            empty = output_text_part("", []) if is_message else reasoning_text_part("")
            part = {"item_id": item["id"], "output_index": self._index, "content_index": 0}
            events.append(("response.content_part.added", {**part, "part": empty}))
        return [
            ("response.output_item.added", {"output_index": self._index, "item": added})
        ] + events

    def _text(self, text: str) -> list[Event]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._close("completed")
            events += self._add(message_item("", "in_progress", []))
        item = self._open
        assert item is not None
        part = item["content"][0]
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        part["text"] += text
        part["logprobs"] += logprobs
        where = {"item_id": item["id"], "output_index": self._index, "content_index": 0}
        events.append(
            ("response.output_text.delta", {**where, "delta": text, "logprobs": logprobs})
        )
        return events

    def _arguments(self, delta: str) -> list[Event]:
        item = self._open
        assert item is not None and item["type"] == "function_call", "arguments before a call"
        item["arguments"] += delta
        where = {"item_id": item["id"], "output_index": self._index}
        return [("response.function_call_arguments.delta", {**where, "delta": delta})]

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        self._open = None
        item["status"] = status
        index = self._index
        done: list[Event] = []
        if item["type"] == "message":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            done.append(
                (
                    "response.output_text.done",
                    {**where, "text": part["text"], "logprobs": list(part["logprobs"])},
                )
            )
            done.append(("response.content_part.done", {**where, "part": copy.deepcopy(part)}))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            done.append(("response.reasoning_text.done", {**where, "text": part["text"]}))
            done.append(("response.content_part.done", {**where, "part": copy.deepcopy(part)}))
        else:
            fields = {"item_id": item["id"], "output_index": index, "name": item["name"]}
            done.append(
                (
                    "response.function_call_arguments.done",
                    {**fields, "arguments": item["arguments"]},
                )
            )
        done.append(
            ("response.output_item.done", {"output_index": index, "item": copy.deepcopy(item)})
        )
        return done
