"""Outputs of tool_choice "required" and of a named function, which a JSON schema
constrains (`ChatCompletionRequest.structured_outputs_params`), so they need no model
format: a named function's output IS its arguments object; "required" gives a JSON array
of `{"name": ..., "parameters": {...}}`."""

from __future__ import annotations

from typing import Any

from serve.chat.tool_parsers.base import (
    OutputParser,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    call_from_json,
    load_json,
)


def named_function_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The output's schema for a named function: its parameters object (none: `{}`)."""
    return parameters or {"type": "object", "properties": {}}


def required_tool_calls_schema(
    functions: dict[str, dict[str, Any] | None], parallel_tool_calls: bool
) -> dict[str, Any]:
    """The output's schema for tool_choice "required": an array of one call or more (one
    at most without parallel calls), each `{"name": <a function>, "parameters": <its
    schema>}`. Each function's `$defs` move to the root, where `#/$defs/...` refers."""
    defs: dict[str, Any] = {}
    variants = []
    for name, parameters in functions.items():
        schema = dict(named_function_schema(parameters))
        for key in ("$defs", "definitions"):
            for def_name, definition in schema.pop(key, {}).items():
                if defs.setdefault(key, {}).setdefault(def_name, definition) != definition:
                    raise ValueError(
                        f"tools: two functions define {key}/{def_name} differently, so "
                        'tool_choice "required" cannot combine their schemas'
                    )
        properties = {"name": {"type": "string", "enum": [name]}, "parameters": schema}
        variants.append(
            {"type": "object", "properties": properties, "required": ["name", "parameters"]}
        )
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel_tool_calls:
        array["maxItems"] = 1
    return {**array, **defs}


class NamedFunctionParser(OutputParser):
    """One call of `name`, whose arguments are the output verbatim (cut short only when
    the output ran out of tokens, as OpenAI's are)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(None, [ToolCall(self.name, text)])

    def stream(self) -> NamedFunctionStream:
        return NamedFunctionStream(self.name)


class NamedFunctionStream(ToolCallStream):
    """The call's header first, then the arguments as they grow."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = [] if self.num_calls else [self._header()]
        if text:
            events.append(ToolCallDelta(0, arguments=text))
        return events

    def finish(self) -> list[StreamEvent]:
        return [] if self.num_calls else [self._header()]

    def _header(self) -> ToolCallDelta:
        return self._start_call(ToolCall(self._name, ""))


class RequiredParser(OutputParser):
    """The calls of a JSON array of `{"name", "parameters"}`; content if the output is not
    one (it ran out of tokens, or was not constrained)."""

    def parse(self, text: str) -> ParsedOutput:
        items = load_json(text)
        if isinstance(items, list) and items:
            calls = [call_from_json(item, ("parameters",)) for item in items]
            if all(call is not None for call in calls):
                return ParsedOutput(None, calls)
        return ParsedOutput(text or None, [])

    def stream(self) -> RequiredStream:
        return RequiredStream(self)


class RequiredStream(ToolCallStream):
    """Holds the array whole and sends its calls at the end."""

    def __init__(self, parser: RequiredParser) -> None:
        super().__init__()
        self._parser = parser
        self._buffer = ""

    def feed(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        return []

    def finish(self) -> list[StreamEvent]:
        parsed = self._parser.parse(self._buffer)
        events: list[StreamEvent] = [parsed.content] if parsed.content else []
        for call in parsed.tool_calls:
            events += self._whole_call(call)
        return events
