"""Llama 3.x JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`
("arguments" also accepted), optionally after `<|python_tag|>`, several separated by `;`.
An output that starts otherwise, or does not parse whole, is content, as written."""

from __future__ import annotations

import json
from typing import Any

from serve.chat.tool_parsers.base import (
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallStream,
    ToolParser,
    call_from_json,
)

PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("parameters", "arguments")

_TOOLS_PROMPT = """Given the following functions, please respond with a JSON for a function \
call with its proper arguments that best answers the given prompt.

Respond in the format {{"name": function name, "parameters": dictionary of argument name \
and its value}}. Do not use variables.

{tools}"""


def _calls(text: str) -> list[ToolCall] | None:
    """The calls of `text` (`;`-separated JSON objects), or None if it is anything else."""
    decoder = json.JSONDecoder()
    calls = []
    position, end = 0, len(text)
    while True:
        while position < end and text[position].isspace():
            position += 1
        if position == end and calls:
            return calls  # a trailing `;` is harmless
        try:
            obj, position = decoder.raw_decode(text, position)
        except (ValueError, RecursionError):
            return None
        call = call_from_json(obj, _ARGUMENT_KEYS)
        if call is None:
            return None
        calls.append(call)
        while position < end and text[position].isspace():
            position += 1
        if position == end:
            return calls
        if text[position] != ";":
            return None
        position += 1


def _starts_calls(head: str) -> bool:
    return head.startswith("{") or head.startswith(PYTHON_TAG)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> ParsedOutput:
        head = text.lstrip()
        calls = _calls(head.removeprefix(PYTHON_TAG)) if _starts_calls(head) else None
        if calls is None:
            return ParsedOutput(text or None, [])
        return ParsedOutput(None, calls)

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream(self)

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n\n".join(json.dumps(tool, indent=4, ensure_ascii=False) for tool in tools)
        return _TOOLS_PROMPT.format(tools=listed)

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(
            json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
            for c in calls
        )


class Llama3JsonStream(ToolCallStream):
    """The first non-space characters decide: an output that starts like a call is held
    whole and parsed at the end; any other streams as content."""

    def __init__(self, parser: Llama3JsonToolParser) -> None:
        super().__init__()
        self._parser = parser
        self._buffer = ""
        self._is_content = False

    def feed(self, text: str) -> list[StreamEvent]:
        if self._is_content:
            return [text] if text else []
        self._buffer += text
        head = self._buffer.lstrip()
        if not head or _starts_calls(head) or PYTHON_TAG.startswith(head):
            return []  # undecided, or a call to hold until the end
        self._is_content = True
        text, self._buffer = self._buffer, ""
        return [text]

    def finish(self) -> list[StreamEvent]:
        parsed = self._parser.parse(self._buffer)
        self._buffer = ""
        events: list[StreamEvent] = [parsed.content] if parsed.content else []
        for call in parsed.tool_calls:
            events += self._whole_call(call)
        return events
