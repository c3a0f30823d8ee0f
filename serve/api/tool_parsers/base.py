"""Tool calls in model output: the shapes parsers return, and the parser interfaces.

An `OutputParser` reads a choice's text in one tool-calling format. `parse` takes the
whole text; `stream()` gives a stateful reader fed the text as it grows, which yields
the same content and calls whatever the split, as content deltas and tool-call deltas
(OpenAI's stream shape). A `ToolParser`, chosen by `--tool-call-parser`, also writes its
format: the tool list for a system prompt and past calls as text, for chat templates that
know nothing of tools.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)  # OpenAI's shape: call_ + 24 characters


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text
    id: str = field(default_factory=new_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when the text was all tool calls (or empty)
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed call: its first delta has `id` and `name`, then fragments of
    its arguments' JSON text follow, as OpenAI streams them."""

    index: int  # the call's position among its choice's calls
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


# One step of a streamed choice: new content text, or a piece of a tool call.
StreamEvent = str | ToolCallDelta


class ToolCallStream(ABC):
    """Reads one choice's text as it grows. Text that may yet turn out to be part of a call
    is held back until it is known; `finish` releases whatever is left."""

    def __init__(self) -> None:
        self.num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[StreamEvent]: ...

    @abstractmethod
    def finish(self) -> list[StreamEvent]: ...

    def _start_call(self, call: ToolCall) -> ToolCallDelta:
        self.num_calls += 1
        return ToolCallDelta(self.num_calls - 1, id=call.id, name=call.name)

    def _whole_call(self, call: ToolCall) -> list[StreamEvent]:
        header = self._start_call(call)
        return [header, ToolCallDelta(header.index, arguments=call.arguments)]


class OutputParser(ABC):
    @abstractmethod
    def parse(self, text: str) -> ParsedOutput: ...

    @abstractmethod
    def stream(self) -> ToolCallStream: ...


class ToolParser(OutputParser):
    """A model family's tool-calling format, for tool_choice "auto"."""

    name: ClassVar[str]

    @abstractmethod
    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """System-prompt text that lists `tools` (OpenAI's tool objects) and asks for calls
        in this format."""

    @abstractmethod
    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        """Past calls (`{"name", "arguments": dict}`) as the model would have written them."""


def call_from_json(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from `{"name": str, <argument key>: object}`, or None if `obj` is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    arguments = {} if key is None else obj[key]
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def load_json(text: str) -> Any:
    """The JSON value of `text`, or None if it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def assemble(pieces: list[str | ToolCall]) -> ParsedOutput:
    """Content and calls from the text between calls and the calls themselves. Whitespace
    that only separates a call from its neighbours is format, not content."""
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    parts = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, ToolCall):
            continue
        if i > 0 and isinstance(pieces[i - 1], ToolCall):
            piece = piece.lstrip()
        if i + 1 < len(pieces) and isinstance(pieces[i + 1], ToolCall):
            piece = piece.rstrip()
        parts.append(piece)
    return ParsedOutput("".join(parts) or None, calls)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
