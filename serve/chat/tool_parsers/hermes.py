"""Hermes / Qwen tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
one block per call, possibly after some content. A block whose JSON is not a call stays in
the content as written; a last block left open (the model stopped before closing it)
still counts if its JSON is whole, as vLLM's hermes parser reads it."""

from __future__ import annotations

import json
import re
from typing import Any

from serve.chat.tool_parsers.base import (
    MarkedBlockStream,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolParser,
    assemble,
    call_from_json,
    load_json,
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


class HermesStream(MarkedBlockStream):
    """`<tool_call>` blocks, each sent whole once `</tool_call>` closes it; a block that
    is not a call goes out as the content it was."""

    start_marker = START

    def block_end(self, block: str) -> tuple[int, int] | None:
        end = block.find(END)
        return None if end < 0 else (end, len(END))

    def block_events(self, body: str, block: str) -> list[StreamEvent]:
        call = _call(body)
        return self.content_events(block) if call is None else self.call_events(call)
