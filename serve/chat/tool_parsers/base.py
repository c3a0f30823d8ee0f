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
from dataclasses import dataclass, field, replace
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


def in_written_order(parser: OutputParser | None, text: str) -> list[str | ToolCall]:
    """A choice's content and calls in the order the model wrote them, as its stream
    reader sends them (text next to a call as `CallSpacing` leaves it): what a reply that
    lays out blocks or items builds, so that it is the same streamed or not."""
    if parser is None:
        return [text] if text else []
    reader = parser.stream()
    pieces: list[str | ToolCall] = []
    at: dict[int, int] = {}  # a call's index -> its place in `pieces`
    for event in reader.feed(text) + reader.finish():
        if isinstance(event, str):
            if pieces and isinstance(pieces[-1], str):
                pieces[-1] += event
            else:
                pieces.append(event)
        elif event.id is not None:
            at[event.index] = len(pieces)
            pieces.append(ToolCall(event.name or "", event.arguments, event.id))
        else:
            call = pieces[at[event.index]]
            assert isinstance(call, ToolCall)
            pieces[at[event.index]] = replace(call, arguments=call.arguments + event.arguments)
    return pieces


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


class CallSpacing:
    """Whitespace next to a call is format, not content, and is dropped; but where content
    goes on after calls, the first run of whitespace after the earlier content joins the
    two, so the words on either side of a call do not fuse. Fed a choice's content and
    calls in order (as whole pieces or as deltas, alike), it says what content to send."""

    def __init__(self) -> None:
        self._sent = False  # some content has been sent
        self._spacing = ""  # the content's trailing whitespace, sent if more content follows
        self._after_call = False  # only whitespace since the last call
        self._lead = ""  # that whitespace
        self._gap = ""  # what joins the content before the calls to the content after

    def content(self, text: str) -> str:
        if self._after_call:
            rest = text.lstrip()
            self._lead += text[: len(text) - len(rest)]
            if not rest:
                return ""
            text = ((self._gap or self._lead) if self._sent else "") + rest
            self._after_call, self._gap, self._lead = False, "", ""
        text = self._spacing + text
        sent = text.rstrip()
        self._spacing = text[len(sent) :]
        self._sent = self._sent or bool(sent)
        return sent

    def call(self) -> None:
        self._gap = self._gap or self._spacing or self._lead
        self._spacing, self._lead, self._after_call = "", "", True

    def finish(self) -> str:
        spacing, self._spacing = self._spacing, ""
        return spacing


def assemble(pieces: list[str | ToolCall]) -> ParsedOutput:
    """Content and calls from the text between calls and the calls themselves."""
    spacing = CallSpacing()
    content = []
    for piece in pieces:
        if isinstance(piece, ToolCall):
            spacing.call()
        else:
            content.append(spacing.content(piece))
    content.append(spacing.finish())
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    return ParsedOutput("".join(content) or None, calls)


class MarkedBlockStream(ToolCallStream):
    """For formats whose calls are blocks opened by a start marker (hermes' `<tool_call>`,
    harmony's `<|start|>`): content streams as it comes, less an end that may be the start
    of the marker and the whitespace a call may yet follow (`CallSpacing`); a call is sent
    whole once its block ends. A format says where a block ends (`block_end`) and what a
    block is (`block_events`); a block the output never ends is read at `finish`."""

    start_marker: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""  # text not yet sent: a possible start marker, or an open block
        self._in_block = False  # the buffer starts with the start marker
        self._spacing = CallSpacing()

    @abstractmethod
    def block_end(self, block: str) -> tuple[int, int] | None:
        """For a block's text so far, from its start marker: (where its body ends, the
        length of the end marker there), or None while it is open."""

    @abstractmethod
    def block_events(self, body: str, block: str) -> list[StreamEvent]:
        """What a closed block sends: its call (`call_events`), or its text as content
        (`content_events(block)`), or nothing. `body` is between the markers, `block`
        the whole of it, markers included."""

    def feed(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        events: list[StreamEvent] = []
        marker = self.start_marker
        while True:
            if self._in_block:
                end = self.block_end(self._buffer)
                if end is None:
                    return events
                body_end, end_length = end
                block = self._buffer[: body_end + end_length]
                self._buffer = self._buffer[len(block) :]
                self._in_block = False
                events += self.block_events(block[len(marker) : body_end], block)
                continue
            start = self._buffer.find(marker)
            if start < 0:
                cut = len(self._buffer) - partial_suffix(self._buffer, marker)
                events += self.content_events(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                return events
            events += self.content_events(self._buffer[:start])
            self._buffer = self._buffer[start:]
            self._in_block = True

    def finish(self) -> list[StreamEvent]:
        if self._in_block:
            events = self.block_events(self._buffer[len(self.start_marker) :], self._buffer)
        else:
            events = self.content_events(self._buffer)
        self._buffer, self._in_block = "", False
        spacing = self._spacing.finish()
        return events + [spacing] if spacing else events

    def call_events(self, call: ToolCall) -> list[StreamEvent]:
        self._spacing.call()
        return self._whole_call(call)

    def content_events(self, text: str) -> list[StreamEvent]:
        sent = self._spacing.content(text)
        return [sent] if sent else []


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
