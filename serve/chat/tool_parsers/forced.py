"""Outputs of tool_choice "required" and of a named function, which a JSON schema
constrains (`ChatCompletionRequest.structured_outputs_params`), so they need no model
format: a named function's output IS its arguments object; "required" gives a JSON array
of `{"name": ..., "parameters": {...}}`. Both stream their calls as they are written, and
an output cut short by max_tokens gives the calls written so far, the last one's
arguments cut short (as OpenAI's are)."""

from __future__ import annotations

from enum import Enum, auto
from typing import Any

from serve.chat.tool_parsers.base import (
    OutputParser,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    assemble,
    in_written_order,
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
    """The calls of a JSON array of `{"name", "parameters"}`, read by `RequiredStream` so
    that a stream and a parse agree: each call whose name was read, its arguments the
    parameters object's text as far as it goes. A text that stops being such an array
    before a name is read (not constrained, or `[]`) is content, as written; the start of
    one that reads no name (`[` when the tokens ran out) is neither content nor calls."""

    def parse(self, text: str) -> ParsedOutput:
        return assemble(in_written_order(self, text))

    def stream(self) -> RequiredStream:
        return RequiredStream()


_SPACE = " \t\n\r"  # JSON's whitespace


class _At(Enum):
    """What `RequiredStream` reads next (after any whitespace), in the array's layout
    `[{"name": "f", "parameters": {...}}, ...]`, keys in the schema's order."""

    ARRAY = auto()  # `[`
    CALL = auto()  # a call's `{`
    NAME_KEY = auto()  # "name"
    NAME_COLON = auto()
    NAME = auto()  # the function's name: a non-empty string
    COMMA = auto()  # the `,` between the name and the parameters
    PARAMETERS_KEY = auto()  # "parameters"
    PARAMETERS_COLON = auto()
    PARAMETERS = auto()  # the parameters object, whose text is the call's arguments
    CALL_END = auto()  # the call's `}`
    NEXT = auto()  # `,` and another call, or `]`
    END = auto()  # nothing: the array has ended, or broke off after a call began


_PUNCTUATION = {  # what each punctuation step reads, and the step after it
    _At.ARRAY: ("[", _At.CALL),
    _At.CALL: ("{", _At.NAME_KEY),
    _At.NAME_COLON: (":", _At.NAME),
    _At.COMMA: (",", _At.PARAMETERS_KEY),
    _At.PARAMETERS_COLON: (":", _At.PARAMETERS),
    _At.CALL_END: ("}", _At.NEXT),
}
_KEYS = {
    _At.NAME_KEY: ("name", _At.NAME_COLON),
    _At.PARAMETERS_KEY: ("parameters", _At.PARAMETERS_COLON),
}


class RequiredStream(ToolCallStream):
    """Reads the array one character at a time: a call's header goes out as soon as its
    name's string closes, then its arguments (the parameters object's text, verbatim) as
    they grow. Text is held until the first name is read: if it stops being the array
    before then (not constrained, or `[]`), all of it is content from there on. After a
    call has begun, a break ends the reading: the calls read so far stand, the last cut
    short, and the rest is dropped, as is everything after the `]` (the grammar allows
    nothing there). The grammar writes json.dumps's layout; any JSON whitespace is read."""

    def __init__(self) -> None:
        super().__init__()
        self._at = _At.ARRAY
        self._held = ""  # the text before the first call's name: content if it breaks
        self._is_content = False
        self._string: str | None = None  # a key or name being read, quotes and escapes kept
        self._escaped = False  # the last character was a `\` inside a string
        self._depth = 0  # brackets open in the parameters object; 0 outside it
        self._in_argument_string = False
        self._fragment: list[str] = []  # arguments read and not yet sent
        self._events: list[StreamEvent] = []

    def feed(self, text: str) -> list[StreamEvent]:
        if self._is_content:
            return [text] if text else []
        if not self.num_calls:
            self._held += text
        for char in text:
            if self._at is _At.END:
                break
            if not self._read(char):
                if not self.num_calls:
                    self._is_content = True
                    return [self._held]
                self._at = _At.END
        self._send_fragment()
        events, self._events = self._events, []
        return events

    def finish(self) -> list[StreamEvent]:
        return []  # content and arguments go out as they are read

    def _read(self, char: str) -> bool:
        """Reads one character; False if the text can no longer be the array."""
        if self._string is not None:
            return self._read_string(char)
        if self._depth:
            return self._read_arguments(char)
        if char in _SPACE:
            return True
        if self._at in _PUNCTUATION:
            expected, after = _PUNCTUATION[self._at]
            if char != expected:
                return False
            self._at = after
        elif self._at in (_At.NAME_KEY, _At.NAME, _At.PARAMETERS_KEY):
            if char != '"':
                return False
            self._string = char
        elif self._at is _At.PARAMETERS:
            if char != "{":
                return False
            return self._read_arguments(char)
        elif self._at is _At.NEXT and char in ",]":
            self._at = _At.CALL if char == "," else _At.END
        else:
            return False
        return True

    def _read_string(self, char: str) -> bool:
        self._string = (self._string or "") + char
        if not self._closes_string(char):
            return True
        value, self._string = load_json(self._string), None
        if self._at is _At.NAME:
            if not isinstance(value, str) or not value:
                return False
            self._held = ""
            self._events.append(self._start_call(ToolCall(value, "")))
            self._at = _At.COMMA
            return True
        key, after = _KEYS[self._at]
        self._at = after
        return value == key

    def _read_arguments(self, char: str) -> bool:
        """The parameters object's text, brackets counted outside its strings (the grammar
        makes it valid JSON; the reader only finds where it ends)."""
        self._fragment.append(char)
        if self._in_argument_string:
            self._in_argument_string = not self._closes_string(char)
        elif char == '"':
            self._in_argument_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if not self._depth:
                self._send_fragment()
                self._at = _At.CALL_END
        return True

    def _closes_string(self, char: str) -> bool:
        """Whether `char`, read inside a string, is its closing quote."""
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        else:
            return char == '"'
        return False

    def _send_fragment(self) -> None:
        if self._fragment:
            arguments = "".join(self._fragment)
            self._events.append(ToolCallDelta(self.num_calls - 1, arguments=arguments))
            self._fragment = []
