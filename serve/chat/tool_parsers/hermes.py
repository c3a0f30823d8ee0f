"""Hermes / Qwen tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
one block per call, possibly after some content. A block whose JSON is not a call stays in
the content as written; a last block left open (the model stopped before closing it)
still counts if its JSON is whole, as vLLM's hermes parser reads it."""

from __future__ import annotations

import json
import re
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
    load_json,
    partial_suffix,
)

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_ARGUMENT_KEYS = ("arguments", "parameters")

_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _call(body: str) -> ToolCall | None:
    return call_from_json(load_json(body), _ARGUMENT_KEYS)


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str) -> ParsedOutput:
        pieces: list[str | ToolCall] = []
        position = 0
        for block in _BLOCK.finditer(text):
            pieces.append(text[position : block.start()])
            body = block.group(1) if block.group(1) is not None else block.group(2)
            pieces.append(_call(body) or block.group(0))
            position = block.end()
        pieces.append(text[position:])
        return assemble(pieces)

    def stream(self) -> HermesStream:
        return HermesStream()

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return _TOOLS_PROMPT.format(tools=listed)

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(
            f"{START}\n{json.dumps(call, ensure_ascii=False)}\n{END}" for call in calls
        )


class HermesStream(ToolCallStream):
    """Content streams as it comes, less an end that may be the start of `<tool_call>`
    and the whitespace a call may yet follow (`CallSpacing`). A call is sent whole once
    its block closes."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""  # text not yet sent: a possible start marker, or an open block
        self._in_block = False
        self._spacing = CallSpacing()

    def feed(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        events: list[StreamEvent] = []
        while True:
            if self._in_block:
                end = self._buffer.find(END)
                if end < 0:
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(END) :]
                self._in_block = False
                events += self._close(body, START + body + END)
                continue
            start = self._buffer.find(START)
            if start < 0:
                cut = len(self._buffer) - partial_suffix(self._buffer, START)
                events += self._content(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
                return events
            events += self._content(self._buffer[:start])
            self._buffer = self._buffer[start + len(START) :]
            self._in_block = True

    def finish(self) -> list[StreamEvent]:
        if self._in_block:
            events = self._close(self._buffer, START + self._buffer)
        else:
            events = self._content(self._buffer)
        self._buffer, self._in_block = "", False
        spacing = self._spacing.finish()
        return events + [spacing] if spacing else events

    def _close(self, body: str, block: str) -> list[StreamEvent]:
        call = _call(body)
        if call is None:
            return self._content(block)
        self._spacing.call()
        return self._whole_call(call)

    def _content(self, text: str) -> list[StreamEvent]:
        sent = self._spacing.content(text)
        return [sent] if sent else []
