"""`parallel_tool_calls: false` under tool_choice "auto": a model's format parser may read
several calls from the text, and the response keeps the first alone (OpenAI's rule: at
most one call a turn; vLLM drops the rest too). Content text is kept as it is."""

from __future__ import annotations

from serve.chat.tool_parsers.base import (
    OutputParser,
    ParsedOutput,
    StreamEvent,
    ToolCallDelta,
    ToolCallStream,
)


class FirstCallOnly(OutputParser):
    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser

    def parse(self, text: str) -> ParsedOutput:
        parsed = self.parser.parse(text)
        return ParsedOutput(parsed.content, parsed.tool_calls[:1])

    def stream(self) -> ToolCallStream:
        return _FirstCallStream(self.parser.stream())


class _FirstCallStream(ToolCallStream):
    def __init__(self, inner: ToolCallStream) -> None:
        super().__init__()
        self.inner = inner

    def feed(self, text: str) -> list[StreamEvent]:
        return self._first_call_only(self.inner.feed(text))

    def finish(self) -> list[StreamEvent]:
        return self._first_call_only(self.inner.finish())

    def _first_call_only(self, events: list[StreamEvent]) -> list[StreamEvent]:
        self.num_calls = min(self.inner.num_calls, 1)
        return [e for e in events if not isinstance(e, ToolCallDelta) or e.index == 0]
