"""Tool-call parsers by name (`--tool-call-parser NAME`), and the forced-choice readers."""

from __future__ import annotations

from serve.chat.tool_parsers.base import (
    OutputParser,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    in_written_order,
)
from serve.chat.tool_parsers.first_call import FirstCallOnly
from serve.chat.tool_parsers.forced import NamedFunctionParser, RequiredParser
from serve.chat.tool_parsers.harmony import HarmonyToolParser
from serve.chat.tool_parsers.hermes import HermesToolParser
from serve.chat.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, HarmonyToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"Unknown tool-call parser {name!r}; choose from {sorted(TOOL_PARSERS)}.")
    return TOOL_PARSERS[name]()


__all__ = [
    "TOOL_PARSERS",
    "FirstCallOnly",
    "NamedFunctionParser",
    "OutputParser",
    "ParsedOutput",
    "RequiredParser",
    "StreamEvent",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
    "in_written_order",
]
