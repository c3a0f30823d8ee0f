"""GPT-OSS's harmony output (`--reasoning-parser openai_gptoss`, `--tool-call-parser
openai`): analysis messages read off as the reasoning, the final channel's as the content,
commentary preambles as content and tool calls passed on to the tool parser as written;
the same split streamed whatever the deltas (token by token, character by character, at
every pair of cut points: markers cut across deltas); where the output starts by the
prompt, where a grammar could start, and the reasoning's token count. The tokenizer is
the tiny test one with harmony's markers added as special tokens (left out of text
decoded the usual way, as o200k_harmony's are). No server."""

from __future__ import annotations

import itertools

import pytest

from serve.chat.reasoning_parsers import get_reasoning_parser, reasoning_parser_for
from serve.chat.reasoning_parsers.gpt_oss import MARKERS, HarmonyReasoning
from serve.chat.tool_parsers import FirstCallOnly, get_tool_parser, in_written_order
from serve.worker.grammar_start import GrammarStart

ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)


@pytest.fixture(scope="module")
def tokenizer():
    import copy

    from tiny_models import build_tokenizer

    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.add_tokens(list(MARKERS), special_tokens=True)
    return tokenizer


@pytest.fixture(scope="module")
def parser(tokenizer):
    return reasoning_parser_for("openai_gptoss", tokenizer)  # as the server builds it


@pytest.fixture(scope="module")
def generation_prompt(tokenizer) -> list[int]:
    """The end of GPT-OSS's chat prompt: the model writes the assistant's header on."""
    return tokenizer.encode("<|start|>user<|message|>Hi<|end|><|start|>assistant")


@pytest.fixture(scope="module")
def reading(parser, generation_prompt) -> HarmonyReasoning:
    return parser.for_request(generation_prompt, {})


def split(reading, text: str) -> tuple[str | None, str | None]:
    parts = reading.split(text)
    return parts.reasoning, parts.content


def streamed(reading, deltas: list[str]) -> tuple[str | None, str | None]:
    reader = reading.stream()
    parts = [*map(reader.feed, deltas), reader.finish()]
    reasoning = "".join(p.reasoning for p in parts)
    content = "".join(p.content for p in parts)
    return reasoning or None, content or None


# --- the whole output -----------------------------------------------------------------------

OUTPUTS = {
    "analysis, then the answer": (
        f"{ANALYSIS}The user asks about France.<|end|>{FINAL}Paris.<|return|>",
        ("The user asks about France.", "Paris."),
    ),
    "no analysis": ("<|channel|>final<|message|>Paris.", (None, "Paris.")),
    "analysis only, cut short": (f"{ANALYSIS}Still thinking", ("Still thinking", None)),
    "cut short in the answer's header": (
        f"{ANALYSIS}Hm.<|end|><|start|>assistant<|chan",
        ("Hm.", None),
    ),
    "two analysis messages join on a line": (
        f"{ANALYSIS}One.<|end|><|start|>assistant{ANALYSIS}Two.<|end|>{FINAL}Yes.",
        ("One.\nTwo.", "Yes."),
    ),
    "a commentary preamble is content": (
        f"{ANALYSIS}Look it up.<|end|><|start|>assistant<|channel|>commentary<|message|>"
        f"Let me check.<|end|>{FINAL}Sunny.",
        ("Look it up.", "Let me check.\nSunny."),
    ),
    "a tool call passes through as written": (
        f"{ANALYSIS}Need the weather.<|end|>{CALL}",
        ("Need the weather.", CALL),
    ),
    "a first message's call, its <|start|> in the prompt": (
        CALL.removeprefix("<|start|>assistant"),
        (None, "<|start|>" + CALL.removeprefix("<|start|>assistant")),
    ),
    "the recipient in the role part": (
        ' to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>',
        (None, '<|start|> to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>'),
    ),
    "a header that skips <|start|>": (
        f"{ANALYSIS}Hm.<|channel|>final<|message|>Yes.",
        ("Hm.", "Yes."),
    ),
    "no harmony at all: a header never ended": ("Just text.", (None, None)),
    "an empty output": ("", (None, None)),
    "text that looks like a marker stays": (
        f"{ANALYSIS}a <|b|> c<|end|>{FINAL}x <|en d",
        ("a <|b|> c", "x <|en d"),
    ),
}


@pytest.mark.parametrize("case", OUTPUTS)
def test_whole_outputs_split(reading, case):
    text, expected = OUTPUTS[case]
    assert split(reading, text) == expected


def test_no_marker_or_channel_name_leaks(reading):
    for text, _ in OUTPUTS.values():
        if "to=" in text:
            continue  # a call is the tool parser's to read
        for part in split(reading, text):
            assert part is None or not any(m in part for m in MARKERS)
            assert part is None or "analysis" not in part and "final" not in part


# --- streaming: the same split whatever the deltas ------------------------------------------


def token_deltas(tokenizer, text: str) -> list[str]:
    """`text` as a server streams it with special tokens kept: each token's new text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, done = [], ""
    for i in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:i], skip_special_tokens=False)
        deltas.append(now[len(done) :])
        done = now
    assert done == text
    return deltas


@pytest.mark.parametrize("case", OUTPUTS)
def test_streamed_token_by_token_and_char_by_char(tokenizer, reading, case):
    text, expected = OUTPUTS[case]
    if text:
        assert streamed(reading, token_deltas(tokenizer, text)) == expected
    assert streamed(reading, list(text)) == expected


@pytest.mark.parametrize(
    "case", ["analysis, then the answer", "a tool call passes through as written"]
)
def test_every_pair_of_cut_points(reading, case):
    text, expected = OUTPUTS[case]
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        assert streamed(reading, [text[:i], text[i:j], text[j:]]) == expected, (i, j)


def test_a_marker_cut_across_deltas_is_held_back_until_known(reading):
    reader = reading.stream()
    assert reader.feed("<|channel|>analy").reasoning == ""  # a header sends nothing
    assert reader.feed("sis<|message|>Plan.<|e").reasoning == "Plan."
    part = reader.feed("nd|><|start|>assistant<|channel|>final<|mess")
    assert (part.reasoning, part.content) == ("", "")
    part = reader.feed("age|>Par")
    assert (part.reasoning, part.content) == ("", "Par")
    assert reader.feed("is.<|ret").content == "is."
    assert reader.finish().content == "<|ret"  # the output ended: it was text after all


# --- the prompt: where the output starts ----------------------------------------------------


def test_where_the_output_starts_by_the_prompt(tokenizer, parser, generation_prompt):
    def read(prompt: str) -> HarmonyReasoning:
        return parser.for_request(tokenizer.encode(prompt), {})

    assert parser.for_request(generation_prompt, {}).in_reasoning  # in the header
    closed = read("<|start|>assistant<|channel|>final<|message|>Hi.<|end|>")
    assert closed.in_reasoning and split(closed, f"<|start|>assistant{ANALYSIS}a") == ("a", None)
    # The prompt opened the answer (continue_final_message): all content.
    opened = read(
        "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Pa"
    )
    assert not opened.in_reasoning
    assert split(opened, f"ris.<|end|><|start|>assistant{ANALYSIS}x") == ("x", "ris.")
    # The prompt opened an analysis message: its text comes first.
    thinking = read(f"<|start|>assistant{ANALYSIS}Hm")
    assert thinking.in_reasoning and split(thinking, f"m.<|end|>{FINAL}Yes.") == ("m.", "Yes.")
    # No harmony turn in the prompt (a plain completion): all content, as written.
    plain = read("Once upon a time")
    assert not plain.in_reasoning and split(plain, "there was") == (None, "there was")


def test_a_grammar_starts_after_the_final_header(reading, parser, tokenizer):
    """The answer starts after `<|channel|>final<|message|>` as the tokenizer writes it
    (`final`, after a special token, is three tokens in this one): a grammar waits for that
    token sequence while the output starts before the answer (in a header, or in an
    analysis message the prompt opened); a prompt that opened the final message starts it
    at once."""
    header = tuple(tokenizer.encode("<|channel|>final<|message|>"))
    vocab = tokenizer.get_vocab()
    assert header == (vocab["<|channel|>"], *tokenizer.encode("final"), vocab["<|message|>"])
    assert len(header) == 5
    assert reading.can_start_grammar and reading.grammar_start_token_ids == header
    thinking = parser.for_request(tokenizer.encode(f"<|start|>assistant{ANALYSIS}Hm"), {})
    assert thinking.opens_in_analysis and thinking.grammar_start_token_ids == header
    answer = parser.for_request(tokenizer.encode(FINAL), {})
    assert answer.can_start_grammar and answer.grammar_start_token_ids == ()


def test_the_grammar_starts_where_the_answers_text_does(reading, tokenizer, generation_prompt):
    """The worker's reading of the start sequence (serve/worker/grammar_start.py) and the
    token counter's agree: the grammar holds the tokens from the answer's first on, past an
    analysis message and a header of another channel."""
    text = (
        f"{ANALYSIS}Think: <|channel|>final is next.<|end|>"
        f"<|start|>assistant<|channel|>analysis<|message|>More.<|end|>{FINAL}Paris.<|return|>"
    )
    ids = tokenizer.encode(text)
    start = GrammarStart.after(reading.grammar_start_token_ids, generation_prompt)
    at = start.completed_at(ids)
    assert at is not None
    assert tokenizer.decode(ids[at + 1 :], skip_special_tokens=True) == "Paris."
    assert reading.token_counter().feed(ids) == at + 1


def test_the_final_header_without_an_encoding(tokenizer, generation_prompt):
    """Given the vocabulary alone, the header is the markers' tokens and `final`'s own, one
    token in o200k_harmony; where `final` is no token, or the encoding does not keep the
    markers whole, no tokens mark the answer: a grammar is refused
    (request_checks.grammar_start) while the output starts before it."""
    vocab = tokenizer.get_vocab()
    one_token = {**vocab, "final": len(vocab)}
    reading = get_reasoning_parser("openai_gptoss", one_token).for_request(generation_prompt, {})
    channel, message = vocab["<|channel|>"], vocab["<|message|>"]
    assert reading.grammar_start_token_ids == (channel, len(vocab), message)
    for parser in (
        get_reasoning_parser("openai_gptoss", vocab),
        get_reasoning_parser("openai_gptoss", vocab, lambda text: [channel, 5, 6]),
    ):
        reading = parser.for_request(generation_prompt, {})
        assert not reading.can_start_grammar and reading.grammar_start_token_ids == ()


def test_a_tokenizer_without_the_markers_is_refused(tokenizer):
    plain = {k: v for k, v in tokenizer.get_vocab().items() if k not in ("<|channel|>", "<|call|>")}
    with pytest.raises(ValueError, match=r"openai_gptoss.*<\|channel\|>, <\|call\|>"):
        get_reasoning_parser("openai_gptoss", plain)


# --- counting the reasoning's tokens --------------------------------------------------------


def test_reasoning_tokens_are_the_analysis_messages_text(tokenizer, reading):
    text = f"{ANALYSIS}one two<|end|>{FINAL}three<|return|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    num_reasoning = len(tokenizer.encode("one two", add_special_tokens=False))
    counter = reading.token_counter()
    skipped = [counter.feed(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert counter.num_tokens == num_reasoning
    # The tokens before the answer's text: up to the final message's <|message|>.
    answer_at = len(tokenizer.encode(text.partition("three")[0], add_special_tokens=False))
    assert sum(skipped) == answer_at
    header = tokenizer.encode("<|channel|>final<|message|>")
    assert reading.token_counter().feed([*header, *tokenizer.encode("x")]) == len(header)


# --- the openai tool parser reads the calls it passes on -------------------------------------


def test_the_tool_parser_reads_the_calls_passed_on(tokenizer, reading):
    tools = get_tool_parser("openai")
    text = f"{ANALYSIS}Need it.<|end|><|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>{CALL}"
    _, content = split(reading, text)
    parsed = tools.parse(content)
    assert parsed.content == "Let me check."
    [call] = parsed.tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    # Streamed: token by token through both parsers, the same content and call.
    thinking, calls = reading.stream(), tools.stream()
    events = []
    for delta in token_deltas(tokenizer, text):
        events += calls.feed(thinking.feed(delta).content)
    events += calls.feed(thinking.finish().content) + calls.finish()
    pieces = [e for e in events if isinstance(e, str)]
    header, arguments = [e for e in events if not isinstance(e, str)]
    assert "".join(pieces) == "Let me check." and header.name == "get_weather"
    assert arguments.arguments == '{"city": "Paris"}' and calls.num_calls == 1


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            '<|start|> to=functions.a<|channel|>commentary json<|message|>{"x": 1}',
            [("a", '{"x": 1}')],
        ),
        # Two calls, the first ended by the second's <|start|>, the second by <|call|>.
        (
            "<|start|>assistant to=functions.a<|message|>{}<|start|>assistant to=functions.b"
            "<|message|>{}<|call|>",
            [("a", "{}"), ("b", "{}")],
        ),
        # A built-in tool's message is no function call: dropped.
        ('<|start|>assistant to=browser.search<|message|>{"q": "x"}<|call|>', []),
    ],
)
def test_tool_calls_whole_and_streamed(content, expected):
    tools = get_tool_parser("openai")
    parsed = tools.parse(content)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == expected
    assert parsed.content is None
    for size in (1, 2, 5):
        reader = tools.stream()
        events = []
        for i in range(0, len(content), size):
            events += reader.feed(content[i : i + size])
        events += reader.finish()
        assert not any(isinstance(e, str) for e in events)
        assert reader.num_calls == len(expected)
    first = FirstCallOnly(tools).parse(content).tool_calls
    assert [(c.name, c.arguments) for c in first] == expected[:1]


def test_past_calls_are_written_as_harmony_and_read_back():
    tools = get_tool_parser("openai")
    written = tools.calls_text([{"name": "get_weather", "arguments": {"city": "Paris"}}])
    assert written == CALL
    pieces = in_written_order(tools, written)
    assert [(c.name, c.arguments) for c in pieces] == [("get_weather", '{"city": "Paris"}')]
    prompt = tools.tools_prompt(
        [{"type": "function", "function": {"name": "f", "description": "Do."}}]
    )
    assert "namespace functions" in prompt and "// Do.\ntype f = (_: {}) => any;" in prompt
