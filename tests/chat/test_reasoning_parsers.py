"""Reasoning parsers (`--reasoning-parser`): a whole output split into reasoning and
content as vLLM 0.32 splits it, and the streaming reader giving the same split whatever
the deltas (token by token over a real tokenizer, character by character, at random
points: markers cut across deltas); which prompts already ended the reasoning, where a
grammar starts, and which output tokens count as reasoning. No server."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve.chat.reasoning_parsers import (
    REASONING_PARSERS,
    RequestReasoning,
    get_reasoning_parser,
)


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny test tokenizer with `<think>`, `</think>` and `<tool_call>` as added tokens
    (as Qwen3's and DeepSeek-R1's tokenizers have them: not special, kept in the text)."""
    import copy

    from tiny_models import build_tokenizer

    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.add_tokens(["<think>", "</think>", "<tool_call>"])
    return tokenizer


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return tokenizer.get_vocab()


def reading(name: str, vocab, prompt_ids=(), **template_kwargs) -> RequestReasoning:
    return get_reasoning_parser(name, vocab).for_request(list(prompt_ids), template_kwargs)


def split(reading: RequestReasoning, text: str) -> tuple[str | None, str | None]:
    parts = reading.split(text)
    return parts.reasoning, parts.content


def streamed(reading: RequestReasoning, deltas: list[str]) -> tuple[str, str]:
    """The reasoning and content a stream of `deltas` joins to; each delta's reasoning
    comes before its content, and no reasoning comes after content."""
    reader = reading.stream()
    reasoning, content = "", ""
    for delta in [*map(reader.feed, deltas), reader.finish()]:
        assert not (content and delta.reasoning), "reasoning after the content began"
        reasoning += delta.reasoning
        content += delta.content
    return reasoning, content


def whole(reading: RequestReasoning, text: str) -> tuple[str, str]:
    reasoning, content = split(reading, text)
    return reasoning or "", content or ""


# --- the whole output, as vLLM 0.32's parsers split it -------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>\nPlan it.\n</think>\n\nParis.", ("\nPlan it.\n", "\n\nParis.")),
        # The template put <think> in the prompt: all before </think> is reasoning.
        ("Plan it.</think>Paris.", ("Plan it.", "Paris.")),
        ("Still thinking, cut short", ("Still thinking, cut short", None)),
        ("Done thinking.</think>", ("Done thinking.", None)),
        ("a</think>b</think>c", ("a", "b</think>c")),  # after the end, content as written
        ("", (None, None)),
    ],
)
def test_deepseek_r1_splits_at_the_end_marker(vocab, text, expected):
    assert split(reading("deepseek_r1", vocab), text) == expected


@pytest.mark.parametrize(
    ("template_kwargs", "text", "expected"),
    [
        ({}, "<think>\nHm.\n</think>\n\nYes.", ("\nHm.\n", "\n\nYes.")),
        ({}, "Hm, no end", ("Hm, no end", None)),
        ({"enable_thinking": True}, "Hm.</think>Yes.", ("Hm.", "Yes.")),
        # enable_thinking false: the output is all content, markers and all (vLLM's qwen3).
        ({"enable_thinking": False}, "Hm.</think>Yes.", (None, "Hm.</think>Yes.")),
        ({"enable_thinking": False}, "", (None, "")),
        # A tool call written while thinking ends the reasoning and is content.
        (
            {},
            "Let me look.<tool_call>\n{}\n</tool_call>",
            ("Let me look.", "<tool_call>\n{}\n</tool_call>"),
        ),
    ],
)
def test_qwen3_thinks_unless_told_not_to(vocab, template_kwargs, text, expected):
    assert split(reading("qwen3", vocab, **template_kwargs), text) == expected


def test_deepseek_v3_thinks_only_when_the_template_is_asked_to(vocab):
    text = "Hm.</think>Yes."
    assert split(reading("deepseek_v3", vocab), text) == (None, text)
    assert split(reading("deepseek_v3", vocab, thinking=True), text) == ("Hm.", "Yes.")
    assert split(reading("deepseek_v3", vocab, enable_thinking=True), text) == ("Hm.", "Yes.")


def test_a_prompt_that_ended_the_reasoning_makes_it_all_content(tokenizer, vocab):
    ended = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    still_open = tokenizer.encode("<|im_start|>assistant\n<think>\n")
    for name in ("deepseek_r1", "qwen3"):
        assert not reading(name, vocab, ended).in_reasoning
        assert split(reading(name, vocab, ended), "a</think>b") == (None, "a</think>b")
        assert reading(name, vocab, still_open).in_reasoning
    # Qwen3 reads back to the last turn boundary only: an earlier turn's </think> is history.
    history = tokenizer.encode("<think>x</think>y<|im_end|>\n<|im_start|>assistant\n")
    assert reading("qwen3", vocab, history).in_reasoning
    assert not reading("deepseek_r1", vocab, history).in_reasoning  # vLLM reads it all


def test_where_the_grammar_starts(vocab):
    end = vocab["</think>"]
    assert reading("deepseek_r1", vocab).grammar_start_token_ids == (end,)
    assert reading("qwen3", vocab).grammar_start_token_ids == (end,)
    assert reading("qwen3", vocab, [end]).grammar_start_token_ids == ()  # already ended
    assert reading("qwen3", vocab, enable_thinking=False).grammar_start_token_ids == ()


def test_markers_that_are_not_tokens(tokenizer):
    """vLLM refuses deepseek_r1 at start-up for such a tokenizer; qwen3 reads the text
    (but cannot start a grammar after a marker it cannot see as a token)."""
    plain = {k: v for k, v in tokenizer.get_vocab().items() if "think>" not in k}
    with pytest.raises(ValueError, match="deepseek_r1.*<think> or </think>"):
        get_reasoning_parser("deepseek_r1", plain)
    qwen3 = reading("qwen3", plain)
    assert split(qwen3, "a</think>b") == ("a", "b")
    assert not qwen3.can_start_grammar and qwen3.grammar_start_token_ids == ()


def test_an_unknown_name_lists_the_parsers(vocab):
    with pytest.raises(ValueError, match="'nope'.*deepseek_r1.*qwen3"):
        get_reasoning_parser("nope", vocab)
    assert {"deepseek_r1", "deepseek_v3", "qwen3"} <= set(REASONING_PARSERS)


# --- streaming: the same split whatever the deltas ------------------------------------------

OUTPUTS = [
    "<think>\nThe user asks about Paris.\n</think>\n\nThe capital of France is Paris.",
    "Let me think: 2 < 3 and 3 > 2.</think>Yes, <b>true</b>.",
    "A thought with a stray </th and <thin in it, never ended",
    'Hm.<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "</think>",
    "<think><think>double</think>\n",
]


def token_deltas(tokenizer, text: str) -> list[str]:
    """`text` as a server streams it: token by token, each token's new text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, done = [], ""
    for i in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:i])
        deltas.append(now[len(done) :])
        done = now
    assert done == text
    return deltas


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_token_by_token_and_char_by_char_joins_to_the_split(tokenizer, vocab, name, text):
    parser = reading(name, vocab)
    expected = whole(parser, text)
    assert streamed(parser, token_deltas(tokenizer, text)) == expected
    assert streamed(parser, list(text)) == expected


def test_a_marker_cut_across_deltas_is_held_back_until_known(vocab):
    reader = reading("deepseek_r1", vocab).stream()
    assert reader.feed("Plan.</th").reasoning == "Plan."  # "</th" may begin </think>
    part = reader.feed("ink>Answer")
    assert (part.reasoning, part.content) == ("", "Answer")
    reader = reading("deepseek_r1", vocab).stream()
    assert reader.feed("x </th").reasoning == "x "
    assert reader.feed("ere").reasoning == "</there"  # it was not a marker after all
    assert reader.finish().reasoning == ""


def test_text_held_back_when_the_output_ends_is_reasoning(vocab):
    reader = reading("qwen3", vocab).stream()
    assert reader.feed("Cut short <").reasoning == "Cut short "
    assert reader.finish().reasoning == "<"


@st.composite
def split_outputs(draw) -> tuple[str, list[str]]:
    pieces = ["<think>", "</think>", "<tool_call>", "<th", "ink>", "</", "<", ">", "a", " ", "\n"]
    text = "".join(draw(st.lists(st.sampled_from(pieces), max_size=10)))
    text += draw(st.text(max_size=3))
    cuts = sorted({c % (len(text) + 1) for c in draw(st.lists(st.integers(0, 100), max_size=8))})
    points = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=300, deadline=None)
@given(split_outputs(), st.sampled_from(["deepseek_r1", "qwen3"]))
def test_random_chunkings_join_to_the_split(output, name):
    text, deltas = output
    vocab = {"<think>": 1000, "</think>": 1001, "<tool_call>": 1002}
    parser = reading(name, vocab)
    assert streamed(parser, deltas) == whole(parser, text)


# --- counting the reasoning's tokens --------------------------------------------------------


def test_reasoning_tokens_are_those_before_the_end_marker(tokenizer, vocab):
    ids = tokenizer.encode("<think>one two</think>three", add_special_tokens=False)
    num_reasoning = len(tokenizer.encode("one two", add_special_tokens=False))
    counter = reading("deepseek_r1", vocab).token_counter()
    skipped = [counter.feed(ids[i : i + 2]) for i in range(0, len(ids), 2)]
    assert counter.num_tokens == num_reasoning
    # The tokens that are no part of the content: <think>, the reasoning, </think>.
    assert sum(skipped) == num_reasoning + 2
    assert reading("qwen3", vocab, enable_thinking=False).token_counter().feed(ids) == 0
    implicit = tokenizer.encode("hm<tool_call>{}", add_special_tokens=False)
    counter = reading("qwen3", vocab).token_counter()
    assert counter.feed(implicit) == implicit.index(vocab["<tool_call>"])  # <tool_call> is content
