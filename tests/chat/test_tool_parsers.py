"""Tool-call parsers, forced-choice schemas and chat rendering with tools; no server.

The streaming readers must agree with the whole-text parse whatever the split of the
text into deltas: hypothesis builds outputs from pieces of each format (whole calls, stray
markers, broken JSON, whitespace) and splits them at random points.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve.chat.rendering import render_chat, template_messages
from serve.chat.tool_parsers import (
    FirstCallOnly,
    NamedFunctionParser,
    OutputParser,
    RequiredParser,
    ToolCallDelta,
    get_tool_parser,
    in_written_order,
)
from serve.chat.tool_parsers.forced import named_function_schema, required_tool_calls_schema

HERMES = get_tool_parser("hermes")
LLAMA3 = get_tool_parser("llama3_json")

WEATHER_ARGS = {"location": "Paris", "unit": "celsius"}
WEATHER_CALL = {"name": "get_weather", "arguments": WEATHER_ARGS}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "unit"],
        },
    },
}


def hermes_block(call: dict) -> str:
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


# --- hermes -------------------------------------------------------------------------------


def test_hermes_single_call():
    parsed = HERMES.parse(hermes_block(WEATHER_CALL))
    assert parsed.content is None
    assert calls_of(parsed) == [("get_weather", WEATHER_ARGS)]
    (call,) = parsed.tool_calls
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24


def test_hermes_several_calls_after_content():
    second = {"name": "get_time", "arguments": {"zone": "CET"}}
    text = f"Let me check.\n{hermes_block(WEATHER_CALL)}\n{hermes_block(second)}\n"
    parsed = HERMES.parse(text)
    assert parsed.content == "Let me check."
    assert calls_of(parsed) == [("get_weather", WEATHER_ARGS), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_hermes_plain_text_is_content():
    assert HERMES.parse("The weather is fine.").content == "The weather is fine."
    assert HERMES.parse("a < b and <tool").content == "a < b and <tool"
    assert HERMES.parse("") == HERMES.parse("")  # no crash on empty output
    assert HERMES.parse("").content is None and HERMES.parse("").tool_calls == []


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n["f"]\n</tool_call>',
        "<tool_call>\n{truncated",
    ],
)
def test_hermes_malformed_call_is_content(block):
    parsed = HERMES.parse(f"Hi {block}")
    assert parsed.tool_calls == [] and parsed.content == f"Hi {block}"


def test_hermes_unclosed_last_call_counts_if_whole():
    parsed = HERMES.parse('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')
    assert calls_of(parsed) == [("f", {"x": 1})] and parsed.content is None


@pytest.mark.parametrize(
    ("before", "between", "after", "content"),
    [
        ("Let me check.\n\n", "\n\n", " Done.", "Let me check.\n\nDone."),
        ("Checking", "\n", "\nthen more", "Checking\nthen more"),
        ("A ", "", "B", "A B"),
        ("A", "", "B", "AB"),  # the model wrote no space: none is made up
        ("", "\n", "Only after.", "Only after."),
    ],
)
def test_hermes_content_around_calls_keeps_its_words_apart(before, between, after, content):
    block = hermes_block(WEATHER_CALL)
    text = f"{before}{block}{between}{block}{after}"
    parsed = HERMES.parse(text)
    assert parsed.content == content and len(parsed.tool_calls) == 2
    assert streamed(HERMES, list(text)) == whole(HERMES, text)


def test_hermes_malformed_block_keeps_its_neighbours():
    bad = "<tool_call>oops</tool_call>"
    parsed = HERMES.parse(f"{bad}\n{hermes_block(WEATHER_CALL)}")
    assert parsed.content == bad and len(parsed.tool_calls) == 1


# --- llama3_json --------------------------------------------------------------------------


def test_llama3_single_call():
    parsed = LLAMA3.parse(json.dumps({"name": "get_weather", "parameters": WEATHER_ARGS}))
    assert parsed.content is None and calls_of(parsed) == [("get_weather", WEATHER_ARGS)]


def test_llama3_python_tag_several_calls_and_arguments_key():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}'
    assert calls_of(LLAMA3.parse(text)) == [("a", {"x": 1}), ("b", {})]
    assert calls_of(LLAMA3.parse('  {"name": "a", "parameters": {}};\n')) == [("a", {})]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "a", "parameters": {"x": 1}} and some words',
        '{"name": "a", "parameters": {"x": 1}',  # cut short
        '{"name": "a", "parameters": 3}',
        '{"nome": "a"}',
        "<|python_tag|>print('hi')",
        "{}",
        '{"name": "Bob"}',  # no "parameters" or "arguments": not a call, as in vLLM
        "",
    ],
)
def test_llama3_anything_else_is_content(text):
    parsed = LLAMA3.parse(text)
    assert parsed.tool_calls == [] and parsed.content == (text or None)


A_CALL = '{"name": "a", "parameters": {"x": 1}}'
B_CALL = '{"name": "b", "arguments": {"s": "} {"}}'
CALLS_READ = {A_CALL: ("a", '{"x": 1}'), B_CALL: ("b", '{"s": "} {"}')}  # (name, arguments)


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        (f"I will check the weather.\n{A_CALL}", "I will check the weather.", ["a"]),
        (f"Two calls: {A_CALL}; {B_CALL}", "Two calls:", ["a", "b"]),
        (f"One per line:\n{A_CALL}\n{B_CALL}\n", "One per line:", ["a", "b"]),
        (f"Tagged. <|python_tag|>{A_CALL};\n", "Tagged.", ["a"]),
        (f"Wait.\n\n{B_CALL}{A_CALL}", "Wait.", ["b", "a"]),
    ],
)
def test_llama3_calls_after_preamble(text, content, names):
    parsed = LLAMA3.parse(text)
    assert parsed.content == content and [c.name for c in parsed.tool_calls] == names
    for deltas in (list(text), [text], split_at(text, [5, 13, 21, 34, 55])):
        assert streamed(LLAMA3, deltas) == whole(LLAMA3, text)


@pytest.mark.parametrize(
    "prose",
    [
        'Reply as {"name": "Bob"}',
        '{"name": "Bob"}',
        f"In JSON, {A_CALL} is how a call looks.",
        "The set {1, 2} is {x | x < 3}",
        '{"a": {"b": [1, 2]}} is nested',
        'Say {"hi" to me}',
    ],
)
def test_llama3_braces_in_prose_are_content_before_a_call(prose):
    assert whole(LLAMA3, prose) == (prose, [])
    reader = LLAMA3.stream()
    assert "".join(reader.feed(prose)) == prose  # known not to be calls before the end
    assert reader.finish() == []
    text = f"{prose}\n{A_CALL}"
    assert whole(LLAMA3, text) == (prose, [CALLS_READ[A_CALL]])
    assert streamed(LLAMA3, list(text)) == whole(LLAMA3, text)


# --- forced choices -----------------------------------------------------------------------


def test_named_function_output_is_the_arguments():
    parsed = NamedFunctionParser("get_weather").parse(json.dumps(WEATHER_ARGS))
    assert parsed.content is None and calls_of(parsed) == [("get_weather", WEATHER_ARGS)]


def test_required_output_is_an_array_of_calls():
    text = json.dumps(
        [{"name": "get_weather", "parameters": WEATHER_ARGS}, {"name": "f", "parameters": {}}]
    )
    parsed = RequiredParser().parse(text)
    assert parsed.content is None
    assert calls_of(parsed) == [("get_weather", WEATHER_ARGS), ("f", {})]
    for bad in ("[]", '[{"name": 1, "parameters": {}}]', "plain text", '{"name": "f"}', " [x"):
        assert RequiredParser().parse(bad).content == bad
        assert RequiredParser().parse(bad).tool_calls == []
        assert streamed(RequiredParser(), list(bad)) == (bad, [])


def test_required_stream_sends_each_call_as_it_is_read():
    reader = RequiredParser().stream()
    assert reader.feed('[{"name": "get_wea') == []
    (header,) = reader.feed('ther", "parameters": ')  # the name is read: the header goes
    assert (header.index, header.name, header.arguments) == (0, "get_weather", "")
    assert header.id.startswith("call_")
    assert reader.feed('{"location": "Pa') == [ToolCallDelta(0, arguments='{"location": "Pa')]
    arguments, second = reader.feed('ris", "unit": "celsius"}}, {"name": "f"')
    assert arguments == ToolCallDelta(0, arguments='ris", "unit": "celsius"}')
    assert (second.index, second.name, second.arguments) == (1, "f", "")
    assert reader.feed(', "parameters": {"s": "}]\\\\"}') == [
        ToolCallDelta(1, arguments='{"s": "}]\\\\"}')  # brackets and escapes in a string
    ]
    assert reader.feed("}]") == [] and reader.finish() == []
    assert reader.num_calls == 2


def test_required_stream_in_small_chunks_sends_calls_before_the_array_ends():
    calls = [{"name": "get_weather", "parameters": WEATHER_ARGS}, {"name": "f", "parameters": {}}]
    text = json.dumps(calls)
    reader = RequiredParser().stream()
    per_feed = [reader.feed(text[i : i + 3]) for i in range(0, len(text), 3)]
    assert reader.finish() == []
    sent = [(i, e) for i, events in enumerate(per_feed) for e in events]
    headers = [(i, e.name) for i, e in sent if e.id is not None]
    first_arguments = [(i, e.arguments) for i, e in sent if e.id is None and e.index == 0]
    assert [name for _, name in headers] == ["get_weather", "f"]
    assert headers[0][0] < first_arguments[0][0] < headers[1][0] < len(per_feed) - 1
    assert len(first_arguments) > 5  # the arguments grow feed by feed
    assert "".join(a for _, a in first_arguments) == json.dumps(WEATHER_ARGS)


TWO_CALLS = json.dumps(
    [
        {"name": "get_weather", "parameters": WEATHER_ARGS},
        {"name": "get_time", "parameters": {"zone": "CET"}},
    ]
)
WEATHER_READ = ("get_weather", json.dumps(WEATHER_ARGS))


@pytest.mark.parametrize(
    ("cut_after", "calls"),
    [
        ('"location": "Pa', [("get_weather", '{"location": "Pa')]),
        ('"get_weather", "para', [("get_weather", "")]),
        ('"name": "get_ti', [WEATHER_READ]),
        ('"name": "get_time"', [WEATHER_READ, ("get_time", "")]),
        ('"zone": "CET"}', [WEATHER_READ, ("get_time", '{"zone": "CET"}')]),
        ("[", []),
    ],
    ids=["in-arguments", "in-key", "in-second-name", "after-name", "unclosed", "after-bracket"],
)
def test_required_cut_short_gives_the_calls_read_so_far(cut_after, calls):
    """Out of tokens, the array's calls so far, the last one's arguments cut short, as a
    named function's are; its text is never content."""
    text = TWO_CALLS[: TWO_CALLS.index(cut_after) + len(cut_after)]
    assert whole(RequiredParser(), text) == ("", calls)
    assert RequiredParser().parse(text).content is None
    for deltas in (list(text), [text], split_at(text, [7, 20, 41])):
        assert streamed(RequiredParser(), deltas) == ("", calls)
        assert streamed(FirstCallOnly(RequiredParser()), deltas) == ("", calls[:1])


def test_required_reads_no_further_than_the_array():
    """The grammar allows nothing after the array, nor a break in it; were there one, the
    calls read stand and the rest is no content."""
    call = '{"name": "f", "parameters": {"x": 1}}'
    for text in (f"[{call}] oops", f"[{call}, oops", f"[{call}, {{}}]", '[{"name": "f", 3'):
        arguments = '{"x": 1}' if "x" in text else ""
        assert whole(RequiredParser(), text) == ("", [("f", arguments)])
        assert streamed(RequiredParser(), list(text)) == whole(RequiredParser(), text)


def test_required_schema_accepts_calls_and_refuses_others():
    other = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
    functions = {"get_weather": WEATHER_TOOL["function"]["parameters"], "get_time": other}
    schema = required_tool_calls_schema(functions, parallel_tool_calls=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [
        {"name": "get_weather", "parameters": WEATHER_ARGS},
        {"name": "get_time", "parameters": {"zone": "CET"}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {"location": "Paris"}}],  # unit is required
        [{"name": "get_time", "parameters": WEATHER_ARGS}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_time"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_tool_calls_schema(functions, parallel_tool_calls=False)
    jsonschema.validate(good[:1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)


def test_required_schema_hoists_defs():
    params = {
        "type": "object",
        "properties": {"place": {"$ref": "#/$defs/Place"}},
        "required": ["place"],
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}}},
    }
    schema = required_tool_calls_schema({"f": params, "g": None}, parallel_tool_calls=True)
    assert "Place" in schema["$defs"]
    jsonschema.validate([{"name": "f", "parameters": {"place": {"city": "Oslo"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"place": {"city": 3}}}], schema)
    clash = {**params, "$defs": {"Place": {"type": "string"}}}
    with pytest.raises(ValueError, match="differently"):
        required_tool_calls_schema({"f": params, "h": clash}, parallel_tool_calls=True)
    assert named_function_schema(None) == {"type": "object", "properties": {}}


# --- streaming agrees with the whole-text parse -------------------------------------------


def streamed(parser: OutputParser, deltas: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call from a stream, checking OpenAI's delta shape:
    each call opens with id, name and empty arguments, then argument fragments follow."""
    reader = parser.stream()
    events = [e for delta in deltas for e in reader.feed(delta)] + reader.finish()
    content, calls = "", []
    for event in events:
        if isinstance(event, str):
            assert event, "no empty content deltas"
            content += event
            continue
        assert isinstance(event, ToolCallDelta)
        if event.id is not None:
            assert event.index == len(calls) and event.arguments == ""
            assert event.id.startswith("call_") and event.name
            calls.append([event.name, ""])
        else:
            assert event.index == len(calls) - 1, "fragments follow their call's header"
            calls[-1][1] += event.arguments
    assert reader.num_calls == len(calls)
    return content, [tuple(c) for c in calls]


def whole(parser: OutputParser, text: str) -> tuple[str, list[tuple[str, str]]]:
    parsed = parser.parse(text)
    return parsed.content or "", [(c.name, c.arguments) for c in parsed.tool_calls]


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


HERMES_PIECES = [
    hermes_block(WEATHER_CALL),
    hermes_block({"name": "f", "arguments": {}}),
    '<tool_call>{"name": "g", "parameters": {"s": "</tool"}}</tool_call>',
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "_call>",
    '{"name": "f", "arguments": {"x": 1}}',
    "{broken",
    "Hello",
    " ",
    "\n",
    "<",
    "a < b",
]
LLAMA3_PIECES = [
    json.dumps({"name": "get_weather", "parameters": WEATHER_ARGS}),
    '{"name": "f", "arguments": {}}',
    '{"name": "g", "parameters": {"s": "}{\\""}}',
    '{"name": "Bob"}',
    '{"a": 1}',
    "Sure. ",
    "<|python_tag|>",
    "<|python",
    ";",
    " ",
    "\n",
    "{",
    "}",
    "Hello",
    "<",
    '"',
    "\\",
]
REQUIRED_PIECES = [
    "[",
    "]",
    ",",
    '{"name": "f", "parameters": {"x": 1}}',
    '{ "name":"g" ,\n"parameters" : {"s": "}]\\"", "l": [{}]} }',
    '{"name": ',
    '"f"',
    '"parameters": ',
    "{",
    "}",
    '"',
    "\\",
    " ",
    "\n",
    "oops",
]


@st.composite
def split_outputs(draw, pieces: list[str]) -> tuple[str, list[str]]:
    text = "".join(draw(st.lists(st.sampled_from(pieces), max_size=8)))
    text += draw(st.text(max_size=3))
    cuts = draw(st.lists(st.integers(min_value=0, max_value=200), max_size=12))
    return text, split_at(text, cuts)


@settings(max_examples=300, deadline=None)
@given(split_outputs(HERMES_PIECES))
def test_hermes_stream_matches_parse(output):
    text, deltas = output
    assert streamed(HERMES, deltas) == whole(HERMES, text)


@settings(max_examples=300, deadline=None)
@given(split_outputs(LLAMA3_PIECES))
def test_llama3_stream_matches_parse(output):
    text, deltas = output
    assert streamed(LLAMA3, deltas) == whole(LLAMA3, text)


@settings(max_examples=300, deadline=None)
@given(split_outputs(REQUIRED_PIECES))
def test_forced_streams_match_parse(output):
    text, deltas = output
    for parser in (RequiredParser(), FirstCallOnly(RequiredParser()), NamedFunctionParser("f")):
        assert streamed(parser, deltas) == whole(parser, text)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda values: st.lists(values, max_size=3) | st.dictionaries(st.text(max_size=3), values),
    max_leaves=6,
)


@st.composite
def cut_required_arrays(draw) -> tuple[str, list[str], list[tuple[str, str]]]:
    """A required array with any JSON whitespace between its tokens, cut anywhere and split
    at random; and the calls read from it: each whose name closed, its arguments (written
    as json.dumps may lay them out) as far as the cut."""

    def space() -> str:
        return draw(st.sampled_from(["", " ", "\n  "]))

    text, spans = space() + "[", []
    objects = st.dictionaries(st.text(max_size=3), JSON_VALUES, max_size=3)
    calls = draw(
        st.lists(st.tuples(st.text(min_size=1, max_size=6), objects), min_size=1, max_size=3)
    )
    for number, (name, parameters) in enumerate(calls):
        text += (space() + "," if number else "") + space() + "{" + space() + '"name"'
        text += space() + ":" + space() + json.dumps(name, ensure_ascii=draw(st.booleans()))
        name_end = len(text)
        text += space() + "," + space() + '"parameters"' + space() + ":" + space()
        separators = draw(st.sampled_from([(", ", ": "), (",", ":"), (" ,\n", " : ")]))
        arguments = json.dumps(parameters, separators=separators, ensure_ascii=False)
        spans.append((name, name_end, len(text), arguments))
        text += arguments + space() + "}"
    text += space() + "]" + space()
    text = text[: draw(st.integers(min_value=0, max_value=len(text)))]
    read = [(n, a[: max(0, len(text) - start)]) for n, end, start, a in spans if end <= len(text)]
    cuts = draw(st.lists(st.integers(min_value=0, max_value=400), max_size=12))
    return text, split_at(text, cuts), read


@settings(max_examples=300, deadline=None)
@given(cut_required_arrays())
def test_required_reads_any_cut_of_an_array(output):
    text, deltas, calls = output
    assert whole(RequiredParser(), text) == ("", calls)
    assert streamed(RequiredParser(), deltas) == ("", calls)
    assert streamed(FirstCallOnly(RequiredParser()), deltas) == ("", calls[:1])


def test_hermes_stream_sends_content_before_a_call_closes():
    reader = HERMES.stream()
    assert reader.feed("Sure.") == ["Sure."]
    assert reader.feed(" <tool_") == []  # may be a call's start; the space may be spacing
    assert reader.feed('call>{"name": "f", "arguments": {}}') == []
    header, arguments = reader.feed("</tool_call>")
    assert (header.name, header.arguments, arguments.arguments) == ("f", "", "{}")
    assert reader.finish() == []


def test_llama3_stream_sends_preamble_before_the_call():
    reader = LLAMA3.stream()
    assert reader.feed("Let me check.") == ["Let me check."]
    assert reader.feed(' {"name": "a", "param') == []  # the space may be spacing
    assert reader.feed('eters": {"x": 1}}') == []  # text may follow: then it is content
    header, arguments = reader.finish()
    assert (header.name, arguments.arguments) == ("a", '{"x": 1}')

    reader = LLAMA3.stream()
    assert reader.feed("Sure <|pyth") == ["Sure"]
    assert reader.feed("on_tag|>" + A_CALL) == []
    assert [e.name for e in reader.finish()] == ["a", None]


PROSE_PIECES = [
    "Let me check.",
    "The set {1, 2}",
    'Reply as {"name": "Bob"}',
    '{"a": 1} is JSON',
    "a < b",
    "{x}",
    "}",
    "<|python",
    "<|python_tag|>",
    A_CALL + " is a call",
]


@st.composite
def preamble_and_calls(draw) -> tuple[str, list[str], list[tuple[str, str]]]:
    """Prose (braces, JSON, a call quoted mid-sentence), then calls that end the output."""
    prose = draw(st.lists(st.sampled_from(PROSE_PIECES), max_size=5))
    text = draw(st.sampled_from([" ", "\n"])).join([*prose, "Done."])
    text += draw(st.sampled_from(["", " ", "\n\n", " <|python_tag|>"]))
    calls = draw(st.lists(st.sampled_from([A_CALL, B_CALL]), min_size=1, max_size=3))
    text += draw(st.sampled_from(["; ", ";", "\n", ";\n", ""])).join(calls)
    text += draw(st.sampled_from(["", ";", "\n"]))
    cuts = draw(st.lists(st.integers(min_value=0, max_value=400), max_size=12))
    return text, split_at(text, cuts), [CALLS_READ[call] for call in calls]


@settings(max_examples=200, deadline=None)
@given(preamble_and_calls())
def test_llama3_finds_calls_after_any_preamble(output):
    text, deltas, calls = output
    preamble = text[: text.index("Done.") + len("Done.")]
    assert whole(LLAMA3, text) == (preamble, calls)
    assert streamed(LLAMA3, deltas) == whole(LLAMA3, text)


def test_named_stream_sends_arguments_as_they_grow():
    reader = NamedFunctionParser("f").stream()
    header, first = reader.feed('{"x": ')
    assert header.name == "f" and first.arguments == '{"x": '
    assert reader.feed("1}") == [ToolCallDelta(0, arguments="1}")]
    assert reader.finish() == []


# --- rendering ----------------------------------------------------------------------------

# A cut-down Qwen2.5 template: it lists the tools and writes calls and results itself.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for tool_call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ tool_call.function.name }}", "arguments": '
    "{{ tool_call.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(WEATHER_ARGS)},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"},
]


@pytest.fixture(scope="module")
def tokenizer():
    from tiny_models import build_tokenizer  # a ChatML template that knows nothing of tools

    return build_tokenizer()


def render(tokenizer, messages, template=None, tools=None, tool_format=None) -> str:
    parsed = template_messages(messages)
    text, ids = render_chat(tokenizer, parsed, True, template, tools, tool_format)
    assert ids == tokenizer(text, add_special_tokens=False).input_ids
    return text


def test_template_messages_follow_the_hf_convention():
    assistant, tool = template_messages(CONVERSATION[1:])
    assert assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"]["arguments"] == WEATHER_ARGS  # an object
    assert tool == {"role": "tool", "content": "22 degrees, sunny", "tool_call_id": "call_1"}


def test_template_that_knows_tools_renders_them_itself(tokenizer):
    text = render(tokenizer, CONVERSATION, TOOL_TEMPLATE, [WEATHER_TOOL])
    assert json.dumps(WEATHER_TOOL) in text
    assert f'"arguments": {json.dumps(WEATHER_ARGS)}}}' in text  # arguments | tojson
    assert "<tool_response>\n22 degrees, sunny\n</tool_response>" in text
    assert "# Tools" not in text  # no second description from us
    assert text.endswith("<|im_start|>assistant\n")


def test_template_without_tools_gets_a_system_prompt_in_the_parser_format(tokenizer):
    text = render(tokenizer, CONVERSATION[:1], tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\n# Tools")
    assert f"<tools>\n{json.dumps(WEATHER_TOOL)}\n</tools>" in text
    assert "<tool_call></tool_call> XML tags" in text

    with_system = [{"role": "system", "content": "Be brief."}, *CONVERSATION[:1]]
    text = render(tokenizer, with_system, tools=[WEATHER_TOOL], tool_format=LLAMA3)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nGiven the following functions")
    assert json.dumps(WEATHER_TOOL, indent=4) in text
    assert text.count("<|im_start|>system") == 1


def test_multi_turn_without_tool_support_writes_calls_as_text(tokenizer):
    text = render(tokenizer, CONVERSATION, tools=[WEATHER_TOOL])
    assert f"<|im_start|>assistant\n{hermes_block(WEATHER_CALL)}<|im_end|>" in text
    assert "<|im_start|>tool\n22 degrees, sunny<|im_end|>" in text
    llama = render(tokenizer, CONVERSATION, tool_format=LLAMA3)
    call = json.dumps({"name": "get_weather", "parameters": WEATHER_ARGS})
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in llama
    assert "# Tools" not in llama and "Given the following" not in llama  # no tools given


def test_rendered_calls_parse_back():
    calls = [WEATHER_CALL, {"name": "f", "arguments": {}}]
    for parser in (HERMES, LLAMA3):
        parsed = parser.parse(parser.calls_text(calls))
        assert calls_of(parsed) == [("get_weather", WEATHER_ARGS), ("f", {})]


def test_in_written_order_is_what_the_stream_sends():
    block = hermes_block(WEATHER_CALL)
    text = f"Before.\n{block}\nAfter.{block}"
    pieces = in_written_order(HERMES, text)
    assert [p if isinstance(p, str) else (p.name, json.loads(p.arguments)) for p in pieces] == [
        "Before.",
        ("get_weather", WEATHER_ARGS),
        "\nAfter.",
        ("get_weather", WEATHER_ARGS),
    ]
    joined = "".join(p for p in pieces if isinstance(p, str))
    assert (joined, [(p.name, p.arguments) for p in pieces if not isinstance(p, str)]) == (
        streamed(HERMES, list(text))
    )
    assert in_written_order(None, "plain") == ["plain"] and in_written_order(None, "") == []
