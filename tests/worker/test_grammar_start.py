"""`GrammarStart`: where a grammar that waits for a token sequence starts (after the output
first completes it), checked on cases (partial matches that break, repeated prefixes as
in GPT-OSS's `<|channel|>analysis…<|channel|>final<|message|>`, the sequence at the very
start, one that begins in the prompt) and against a brute-force reading of random
streams, read token by token as the sampler reads them and cut at every point as
speculation reads them (the state before a proposal found from the tokens alone)."""

from __future__ import annotations

import random

import pytest

from serve.worker.grammar_start import GrammarStart

# Token ids standing for harmony's: <|channel|> f in al <|message|> (final, in 3 tokens).
C, F, IN, AL, M = 513, 72, 264, 297, 515
ANALYSIS = (60, 77)  # "analysis", in tokens
FINAL_HEADER = (C, F, IN, AL, M)


def first_start(sequence: tuple[int, ...], prompt: list[int], output: list[int]) -> int | None:
    """The reference: the index of the first output token at which prompt + output ends
    with the whole sequence."""
    tokens = prompt + output
    for i in range(len(output)):
        end = len(prompt) + i + 1
        if end >= len(sequence) and tuple(tokens[end - len(sequence) : end]) == sequence:
            return i
    return None


def read(sequence: tuple[int, ...], prompt: list[int], output: list[int]) -> int | None:
    """As the sampler reads an output: the state from the prompt, then token by token."""
    state: GrammarStart | None = GrammarStart.after(sequence, prompt)
    for i, token in enumerate(output):
        assert state is not None
        state = state.advance(token)
        if state is None:
            return i
    return None


CASES = [
    # (what it shows, sequence, prompt, output, index of the token that starts it)
    ("the whole header", FINAL_HEADER, [], [1, 2, C, F, IN, AL, M, 5], 6),
    ("at the very start", FINAL_HEADER, [], [C, F, IN, AL, M], 4),
    ("analysis first", FINAL_HEADER, [], [C, *ANALYSIS, M, 9, C, F, IN, AL, M], 9),
    ("a partial match that breaks", FINAL_HEADER, [], [C, F, IN, 9, M, 9, AL, M], None),
    ("a token short", FINAL_HEADER, [], [C, F, IN, AL], None),
    ("out of order", FINAL_HEADER, [], [F, IN, AL, C, M], None),
    ("a broken match's last token starts anew", FINAL_HEADER, [], [C, F, C, F, IN, AL, M], 6),
    ("a repeated first token", FINAL_HEADER, [], [C, C, C, F, IN, AL, M], 6),
    ("only the first completion", (7, 8), [], [7, 8, 7, 8], 1),
    ("begun in the prompt", FINAL_HEADER, [4, C, F], [IN, AL, M, 1], 2),
    ("a whole one in the prompt is not counted", FINAL_HEADER, [C, F, IN, AL, M], [1, M], None),
    ("one token", (9,), [9], [1, 9, 9], 1),
    ("self-overlapping", (1, 1, 2), [], [1, 1, 1, 1, 2], 4),
    ("self-overlapping, broken", (1, 2, 1, 3), [], [1, 2, 1, 2, 1, 3], 5),
]


@pytest.mark.parametrize(
    ("sequence", "prompt", "output", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_the_grammar_starts_after_the_first_whole_match(sequence, prompt, output, expected):
    assert first_start(sequence, prompt, output) == expected  # the case says what it means
    assert read(sequence, prompt, output) == expected
    assert GrammarStart.after(sequence, prompt).completed_at(output) == expected


def test_random_streams_read_alike_whole_and_cut_anywhere():
    """Over a small alphabet (many partial matches): token by token, and at every cut, the
    state found from the tokens before it (as speculation finds it) reads the rest alike."""
    rng = random.Random(0)
    for _ in range(400):
        sequence = tuple(rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 4)))
        prompt = [rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 4))]
        output = [rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 12))]
        expected = first_start(sequence, prompt, output)
        assert read(sequence, prompt, output) == expected
        for cut in range(len(output) + 1):
            if expected is not None and expected < cut:
                break  # the grammar started already
            state = GrammarStart.after(sequence, prompt + output[:cut])
            at = state.completed_at(output[cut:])
            assert (None if at is None else cut + at) == expected, (sequence, prompt, output)
