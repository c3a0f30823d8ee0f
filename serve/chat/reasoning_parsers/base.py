"""Reasoning in model output: the thinking a reasoning model writes before its answer
(DeepSeek-R1 and its distills, Qwen3, QwQ: `<think>…</think>`; GPT-OSS: its harmony
messages, gpt_oss.py), read apart from it.

A `ReasoningParser`, chosen by `--reasoning-parser`, knows its family's markers and which
tokens of the server's tokenizer they are. For each request it gives a `RequestReasoning`:
whether the output starts inside the reasoning (the prompt may have closed it already, or
the chat template was asked not to think), which then

- splits a whole output into reasoning and content (`split`),
- streams a growing one as reasoning and content deltas (`stream`), the same split
  whatever the deltas: a marker cut across deltas is held back until it is known,
- counts the output tokens that are reasoning (`token_counter`), for the usage,
- names the tokens after which the request's grammar starts (`grammar_start_token_ids`):
  structured output holds the answer to its format, never the thinking before it. The
  answer starts after the end marker's token (GPT-OSS: after the tokens of its final
  message's header); where no tokens mark it, a grammar cannot wait for it.

Within the reasoning, start markers are dropped (a template may put one in the prompt, a
model may write one); the end marker is dropped and everything after it is content, as
written. A parser's implicit ends (Qwen3: a tool call written while still thinking) end the
reasoning too and stay in the content.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from serve.chat.tool_parsers.base import partial_suffix

# The tokenizer's ids for a text, its special tokens read as tokens
# (`tokenizer.encode(text, add_special_tokens=False)`).
Encode = Callable[[str], Sequence[int]]


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: there is no reasoning (or it is empty)
    content: str | None  # None: no answer after the reasoning (or none yet)


@dataclass(frozen=True)
class ReasoningDelta:
    """What a piece of streamed output adds: to the reasoning, then to the content."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """A model family's reasoning markers, resolved against a tokenizer's vocabulary."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # Markers that end the reasoning and begin the content, where they stay.
    implicit_ends: ClassVar[tuple[str, ...]] = ()
    # Special tokens that open or close a turn: the prompt is read back to the last of
    # them for a marker; with none, to its start.
    turn_boundaries: ClassVar[tuple[str, ...]] = ()
    # Refuse a tokenizer in which the start and end markers are not single tokens (vLLM
    # refuses it at start-up for these parsers; the others read the text alone).
    needs_marker_tokens: ClassVar[bool] = False
    # The markers are special tokens, which decoded text leaves out: the chat handler
    # decodes the output with special tokens kept for this parser (gpt_oss.py).
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, vocab: Mapping[str, int], encode: Encode | None = None) -> None:
        """`vocab`: the tokenizer's (`get_vocab()`); `encode`: its encoding, for a parser
        whose answer starts after several tokens (gpt_oss.py; the others read the vocab)."""
        missing = [marker for marker in (self.start, self.end) if marker not in vocab]
        if self.needs_marker_tokens and missing:
            raise ValueError(
                f"--reasoning-parser {self.name} cannot be used with this model: its tokenizer "
                f"has no {' or '.join(missing)} token (the parser finds the reasoning's "
                f"{self.start} and {self.end} markers by their tokens)."
            )
        self.start_token_id: int | None = vocab.get(self.start)
        self.end_token_id: int | None = vocab.get(self.end)
        self.implicit_end_token_ids = frozenset(
            vocab[marker] for marker in self.implicit_ends if marker in vocab
        )
        self.boundary_token_ids = frozenset(
            vocab[token] for token in self.turn_boundaries if token in vocab
        )
        # The tokens after which the answer starts, as the model writes them; None: no
        # tokens mark it (a grammar cannot wait for it).
        self.answer_start_token_ids: tuple[int, ...] | None = (
            (self.end_token_id,) if self.end_token_id is not None else None
        )

    def thinks(self, template_kwargs: Mapping[str, Any]) -> bool:
        """Whether the model thinks before it answers, as the chat template was asked
        (its variables: `chat_template_kwargs` over the server's defaults)."""
        return True

    def prompt_ends_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """The prompt closed the reasoning: read back from its end (to the last turn
        boundary), an end marker's token comes before any start marker's."""
        ends = self.implicit_end_token_ids | {self.end_token_id}
        for token_id in reversed(prompt_token_ids):
            if token_id in ends:
                return True
            if token_id == self.start_token_id or token_id in self.boundary_token_ids:
                return False
        return False

    def for_request(
        self, prompt_token_ids: Sequence[int], template_kwargs: Mapping[str, Any]
    ) -> RequestReasoning:
        thinking = self.thinks(template_kwargs)
        return RequestReasoning(self, thinking and not self.prompt_ends_reasoning(prompt_token_ids))

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.start, self.end, *self.implicit_ends)


@dataclass(frozen=True)
class RequestReasoning:
    """One request's reading of its output (each of its choices alike)."""

    parser: ReasoningParser
    in_reasoning: bool  # the output starts inside the reasoning; else it is all content

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.parser, self.in_reasoning)

    def split(self, text: str) -> ReasoningSplit:
        """A whole output's reasoning and content, as its stream gives them."""
        if not self.in_reasoning:
            return ReasoningSplit(None, text)
        reader = self.stream()
        fed, rest = reader.feed(text), reader.finish()
        reasoning, content = fed.reasoning + rest.reasoning, fed.content + rest.content
        return ReasoningSplit(reasoning or None, content or None)

    def token_counter(self) -> ReasoningTokens:
        return ReasoningTokens(self.parser, self.in_reasoning)

    @property
    def grammar_start_token_ids(self) -> tuple[int, ...]:
        """The token sequence after which the request's grammar starts (StructuredOutputs
        Params.start_after_token_ids): the answer's start while the output starts in the
        reasoning; none (from the first token) otherwise."""
        if not self.in_reasoning or self.parser.answer_start_token_ids is None:
            return ()
        return self.parser.answer_start_token_ids

    @property
    def can_start_grammar(self) -> bool:
        """A grammar can be held back until the reasoning ends: tokens mark its end."""
        return not self.in_reasoning or self.parser.answer_start_token_ids is not None


class ReasoningStream:
    """Reads one choice's text as it grows. Inside the reasoning, text that may be the
    start of a marker is held back until the next text says; `finish` releases it (as
    reasoning: the output ended inside it). After the reasoning, text passes as content."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool) -> None:
        self._parser = parser
        self._in_reasoning = in_reasoning
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        return self._in_reasoning

    def feed(self, text: str) -> ReasoningDelta:
        if not self._in_reasoning:
            return ReasoningDelta(content=text)
        parser = self._parser
        text, self._held = self._held + text, ""
        reasoning = []
        while True:
            found = [(text.find(m), m) for m in parser.markers if m in text]
            if not found:
                cut = len(text) - max(partial_suffix(text, m) for m in parser.markers)
                self._held = text[cut:]
                return ReasoningDelta("".join(reasoning) + text[:cut])
            at, marker = min(found)
            reasoning.append(text[:at])
            if marker == parser.start:
                text = text[at + len(marker) :]
                continue
            self._in_reasoning = False
            content = text[at + len(marker) :] if marker == parser.end else text[at:]
            return ReasoningDelta("".join(reasoning), content)

    def finish(self) -> ReasoningDelta:
        held, self._held = self._held, ""
        return ReasoningDelta(reasoning=held)


class ReasoningTokens:
    """Counts one choice's output tokens that are reasoning, fed them as they come: those
    before the end marker's token, start markers left out. Where the end marker is no
    single token, nothing is counted."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool) -> None:
        self.num_tokens = 0
        self._counting = in_reasoning and parser.end_token_id is not None
        self._start, self._end = parser.start_token_id, parser.end_token_id
        self._implicit_ends = parser.implicit_end_token_ids

    def feed(self, token_ids: Sequence[int]) -> int:
        """Take the next tokens; returns how many of them, from the first, are no part of
        the content (the reasoning and its markers)."""
        if not self._counting:
            return 0
        for i, token_id in enumerate(token_ids):
            if token_id == self._end or token_id in self._implicit_ends:
                self._counting = False
                return i + 1 if token_id == self._end else i
            if token_id != self._start:
                self.num_tokens += 1
        return len(token_ids)
