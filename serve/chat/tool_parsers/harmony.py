"""GPT-OSS's tool calls (`--tool-call-parser openai`): harmony messages to a function,

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

(one line), as `--reasoning-parser openai_gptoss` passes them on in the content, from
`<|start|>` to the end marker, having read GPT-OSS's other messages off already. Without
that parser the markers, special tokens, are not in the text: this one reads nothing.

A call's arguments are its message's text as written (vLLM's openai parser takes them
so); it ends at `<|call|>` (the text leaves that stop token out), `<|end|>`, `<|return|>`,
the next `<|start|>` or the end of the text. A message to another recipient (a built-in
tool: `browser.search`, `python`) is no function call, and is dropped, as vLLM drops it.
"""

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
)

START, MESSAGE = "<|start|>", "<|message|>"
ENDS = ("<|call|>", "<|end|>", "<|return|>")
_FUNCTION = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)")


def _call(block: str) -> ToolCall | None:
    """The call a message (its header, `<|message|>`, its text) makes, if it is one."""
    header, found, arguments = block.partition(MESSAGE)
    function = _FUNCTION.search(header)
    if not found or function is None:
        return None
    return ToolCall(function.group(1), arguments.strip())


def _block_end(text: str) -> tuple[int, int] | None:
    """Where the message at the start of `text` ends: (its length, its end marker's), or
    None while it has not ended."""
    found = [(at, len(m)) for m in ENDS if (at := text.find(m)) >= 0]
    if (at := text.find(START, len(START))) >= 0:
        found.append((at, 0))
    return min(found) if found else None


class HarmonyToolParser(ToolParser):
    name = "openai"

    def parse(self, text: str) -> ParsedOutput:
        pieces: list[str | ToolCall] = []
        while (start := text.find(START)) >= 0:
            pieces.append(text[:start])
            text = text[start:]
            end = _block_end(text)
            length, marker = end if end is not None else (len(text), 0)
            call = _call(text[len(START) : length])
            if call is not None:
                pieces.append(call)
            text = text[length + marker :]
        pieces.append(text)
        return assemble(pieces)

    def stream(self) -> HarmonyToolStream:
        return HarmonyToolStream()

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Harmony's tools section (a template that knows no tools gets it as a system
        message); each function's parameters as their JSON schema."""
        lines = ["# Tools", "", "## functions", "", "namespace functions {", ""]
        for tool in tools:
            function = tool.get("function", tool)
            if function.get("description"):
                lines.append(f"// {function['description']}")
            parameters = json.dumps(function.get("parameters") or {}, ensure_ascii=False)
            lines += [f"type {function['name']} = (_: {parameters}) => any;", ""]
        return "\n".join([*lines, "} // namespace functions"])

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return "".join(
            f"{START}assistant<|channel|>commentary to=functions.{call['name']} "
            f"<|constrain|>json{MESSAGE}{json.dumps(call['arguments'], ensure_ascii=False)}"
            "<|call|>"
            for call in calls
        )


class HarmonyToolStream(MarkedBlockStream):
    """Messages opened by `<|start|>`, each call sent whole once its message ends; a
    message that is no call is dropped (the reasoning parser kept its content)."""

    start_marker = START

    def block_end(self, block: str) -> tuple[int, int] | None:
        return _block_end(block)

    def block_events(self, body: str, block: str) -> list[StreamEvent]:
        call = _call(body)
        return [] if call is None else self.call_events(call)
