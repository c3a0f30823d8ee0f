"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` ("arguments" also
accepted), optionally after `<|python_tag|>`, several separated by `;` or whitespace. The
calls end the output; text before them (a sentence the model wrote first) is content.

The run of calls starts at the earliest `{` or `<|python_tag|>` from which the rest of the
output is wholly calls; an output with no such start is content, as written. A call is an
object with a "name" and a "parameters" or "arguments" object, as vLLM's parser asks.
vLLM reads calls anywhere and drops the text around them (and reads no call at all if any
other `{` is not one); asking the calls to end the output keeps JSON and braces that prose
quotes in its content, and lets a stream send its content before the output ends."""

from __future__ import annotations

import json
import re
from enum import Enum, auto
from typing import Any

from serve.chat.tool_parsers.base import (
    CallSpacing,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallStream,
    ToolParser,
    assemble,
    call_from_json,
    partial_suffix,
)

PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("parameters", "arguments")
_START = re.compile(r"\{|" + re.escape(PYTHON_TAG))  # where a run of calls may start
_DECODER = json.JSONDecoder()
_JSON_SPACE = " \t\n\r"
# All that valid JSON may hold outside its strings: structure, numbers, true/false/null,
# and Python's NaN/Infinity.
_OUTSIDE_STRINGS = frozenset(_JSON_SPACE + "{}[]:,-+.0123456789eE" + "truefalsnNIiy")

_TOOLS_PROMPT = """Given the following functions, please respond with a JSON for a function \
call with its proper arguments that best answers the given prompt.

Respond in the format {{"name": function name, "parameters": dictionary of argument name \
and its value}}. Do not use variables.

{tools}"""


def _decode_call(text: str, position: int) -> tuple[ToolCall | None, int]:
    """The call whose JSON starts at `text[position]`, and where its JSON ends; a call of
    None if it is not one (not JSON, or no arguments key: `{"name": "Bob"}` is no call)."""
    try:
        obj, end = _DECODER.raw_decode(text, position)
    except (ValueError, RecursionError):
        return None, position
    if not isinstance(obj, dict) or not any(key in obj for key in _ARGUMENT_KEYS):
        return None, end
    return call_from_json(obj, _ARGUMENT_KEYS), end


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def _calls(text: str, start: int) -> list[ToolCall] | None:
    """The calls `text[start:]` is wholly made of: `[<|python_tag|>] call ([;] call)* [;]`,
    space anywhere between; None if it is anything else."""
    position = start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start
    calls = []
    while True:
        call, position = _decode_call(text, _skip_space(text, position))
        if call is None:
            return None
        calls.append(call)
        position = _skip_space(text, position)
        if text.startswith(";", position):
            position = _skip_space(text, position + 1)
        if position == len(text):
            return calls


def _next_start(text: str, position: int) -> int:
    """Where the first possible run of calls at or after `position` starts; -1 if none."""
    match = _START.search(text, position)
    return match.start() if match else -1


def _split(text: str) -> tuple[str, list[ToolCall]]:
    """The text before the run of calls that ends `text`, and its calls ([] if none)."""
    start = _next_start(text, 0)
    while start >= 0:
        calls = _calls(text, start)
        if calls is not None:
            return text[:start], calls
        start = _next_start(text, start + 1)
    return text, []


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> ParsedOutput:
        before, calls = _split(text)
        return assemble([before, *calls])

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream()

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n\n".join(json.dumps(tool, indent=4, ensure_ascii=False) for tool in tools)
        return _TOOLS_PROMPT.format(tools=listed)

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(
            json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
            for c in calls
        )


class Llama3JsonStream(ToolCallStream):
    """Content streams as it comes, less an end that may be the start of `<|python_tag|>`
    and the whitespace a call may yet follow (`CallSpacing`). From a `{` or the tag, text is
    held while it may still be the run of calls that ends the output (`_RunReader` says
    when it no longer can: then it is content up to the next possible start). Calls are
    known only at the end, so they are sent whole by `finish`."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""  # text not yet sent: a possible run of calls, or a partial tag
        self._run: _RunReader | None = None  # reads `_buffer` while it may be a run
        self._spacing = CallSpacing()

    def feed(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        events: list[StreamEvent] = []
        while True:
            if self._run is None:
                start = _next_start(self._buffer, 0)
            elif self._run.can_be_calls(self._buffer):
                return events
            else:
                start = _next_start(self._buffer, 1)
            if start < 0:
                cut = len(self._buffer) - partial_suffix(self._buffer, PYTHON_TAG)
                events += self._content(self._buffer[:cut])
                self._buffer, self._run = self._buffer[cut:], None
                return events
            events += self._content(self._buffer[:start])
            self._buffer = self._buffer[start:]
            self._run = _RunReader(self._buffer)

    def finish(self) -> list[StreamEvent]:
        before, calls = _split(self._buffer)
        self._buffer, self._run = "", None
        events = self._content(before)
        for call in calls:
            self._spacing.call()
            events += self._whole_call(call)
        spacing = self._spacing.finish()
        return events + [spacing] if spacing else events

    def _content(self, text: str) -> list[StreamEvent]:
        sent = self._spacing.content(text)
        return [sent] if sent else []


class _Expect(Enum):
    CALL = auto()  # space, then a call's `{` (after the tag, or after a `;`)
    IN_CALL = auto()  # inside a call's JSON
    AFTER_CALL = auto()  # space, then a `;`, another call's `{`, or the end


class _RunReader:
    """Reads text that starts with `{` or `<|python_tag|>` as it grows, and says as soon as
    no text that may follow can make it wholly calls (`_calls`). It reads each character
    once, keeping only where strings and objects open and close; a call's JSON is decoded
    when its last brace closes. Text no ending can save may still read as a possible run
    only while it stays inside a string or an object that its prefix leaves open."""

    def __init__(self, text: str) -> None:
        self._expect = _Expect.CALL if text.startswith(PYTHON_TAG) else _Expect.IN_CALL
        self._position = len(PYTHON_TAG) if self._expect is _Expect.CALL else 0
        self._call_start = 0  # where the call being read starts
        self._depth = 0  # how many of its objects are open
        self._in_string = self._escaped = False
        self._after_brace = False  # only JSON space since a `{`: a key or `}` must follow

    def can_be_calls(self, text: str) -> bool:
        """Reads on from where the last call left off; `text` is that text grown."""
        while self._position < len(text):
            char = text[self._position]
            if char == "{" and self._expect is not _Expect.IN_CALL:
                self._expect, self._call_start = _Expect.IN_CALL, self._position
            if self._expect is _Expect.IN_CALL:
                if not self._read_json(text, char):
                    return False
            elif char == ";" and self._expect is _Expect.AFTER_CALL:
                self._expect = _Expect.CALL
            elif not char.isspace():
                return False
            self._position += 1
        return True

    def _read_json(self, text: str, char: str) -> bool:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
            return True
        if self._after_brace:
            if char in _JSON_SPACE:
                return True
            if char not in '"}':
                return False
            self._after_brace = False
        if char == '"':
            self._in_string = True
        elif char == "{":
            self._depth += 1
            self._after_brace = True
        elif char == "}":
            self._depth -= 1
            if self._depth == 0:
                call, end = _decode_call(text, self._call_start)
                if call is None:
                    return False
                self._expect, self._position = _Expect.AFTER_CALL, end - 1
        elif char not in _OUTSIDE_STRINGS:
            return False
        return True
