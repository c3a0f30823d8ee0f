"""GPT-OSS's reasoning: OpenAI's harmony format, read as vLLM's openai_gptoss reads it.

GPT-OSS writes messages. Its chat template ends the prompt with `<|start|>assistant`; the
model goes on with a header (a channel, maybe a recipient and a format) and the message:

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

- `analysis` messages are the reasoning;
- `final` messages (and any other channel's, `commentary` preambles among them) are the
  content; messages after the first of a kind join it on a new line, as vLLM joins them;
- a message to a recipient (`to=functions.get_weather`, in the role or the channel part
  of its header) is a tool call: it passes into the content as written, from `<|start|>`
  to its end marker (`<|start|>` put back where the prompt held it), for the `openai`
  tool parser (tool_parsers/harmony.py) to read;
- the markers (`<|start|>`, `<|channel|>`, `<|constrain|>`, `<|message|>`, `<|end|>`,
  `<|return|>`, `<|call|>`) and headers are in neither; a header the output never ends
  (cut short, or no harmony at all) is dropped.

The markers are special tokens of GPT-OSS's tokenizer, which a decoded text leaves out:
the parser's `keeps_special_tokens` makes the chat handler decode these requests' text with
them kept (`skip_special_tokens` false), and the parser reads them in the text. The
tokenizer must have them as tokens (start-up refuses one without them); the reasoning's
tokens are counted by them.

Where the output starts, read from the prompt back to its last `<|start|>`: in a header
(the template's generation prompt, or a message already closed); in an analysis message's
text, if the prompt opened one; in the content, if the prompt opened another message, or
has no harmony turn at all (a plain completion).

Structured output holds the answer alone: a request's grammar starts after the final
message's header, `<|channel|>final<|message|>` as the tokenizer writes it (the word is
one token in o200k_harmony, after a special token; it may be several in another), once
the output completes that token sequence (serve/worker/grammar_start.py): the analysis
and any other message before it stay free. A prompt that opened the final message starts
the grammar at once, and so does a request that leaves its reasoning out (include_reasoning
false: the grammar then holds the whole output), as with the other parsers.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from serve.chat.reasoning_parsers.base import (
    Encode,
    ReasoningDelta,
    ReasoningParser,
    ReasoningSplit,
    RequestReasoning,
)
from serve.chat.tool_parsers.base import partial_suffix

START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MESSAGE_ENDS = (END, RETURN, CALL)
MARKERS = (START, CHANNEL, CONSTRAIN, MESSAGE, *MESSAGE_ENDS)
_LONGEST_MARKER = max(map(len, MARKERS))
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"([A-Za-z_]+)")


class Kind(enum.Enum):
    """What a message's text is."""

    REASONING = "reasoning"  # the analysis channel
    CONTENT = "content"  # final, a commentary preamble, any other channel
    CALL = "call"  # a message to a recipient: passed to the tool parser as written


def message_kind(header: str) -> Kind:
    """A message's kind by its header: what came between `<|start|>` and `<|message|>`
    (its markers in it), e.g. `assistant<|channel|>commentary to=functions.f <|constrain|>json`."""
    if "to=" in header:
        return Kind.CALL
    channel = _CHANNEL_NAME.search(header)
    return Kind.REASONING if channel and channel.group(1) == "analysis" else Kind.CONTENT


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    # The reasoning's bounds: several tokens each. A grammar starts after `end`'s tokens.
    start = CHANNEL + "analysis" + MESSAGE
    end = CHANNEL + "final" + MESSAGE
    keeps_special_tokens = True

    def __init__(self, vocab: Mapping[str, int], encode: Encode | None = None) -> None:
        missing = [marker for marker in MARKERS if marker not in vocab]
        if missing:
            raise ValueError(
                f"--reasoning-parser {self.name} cannot be used with this model: its tokenizer "
                f"has no {', '.join(missing)} token (the parser reads GPT-OSS's harmony "
                "messages by their special tokens)."
            )
        super().__init__(vocab)
        self.marker_ids = {marker: vocab[marker] for marker in MARKERS}
        self.answer_start_token_ids = self._header_ids(self.end, vocab, encode)
        self._markers_by_id = {token_id: marker for marker, token_id in self.marker_ids.items()}
        # A header's tokens as text, to tell its channel and recipient (byte-level pieces:
        # the letters, `=` and `.` are themselves).
        self._token_text = {token_id: token for token, token_id in vocab.items()}

    def _header_ids(
        self, header: str, vocab: Mapping[str, int], encode: Encode | None
    ) -> tuple[int, ...] | None:
        """`header`'s tokens (`<|channel|>NAME<|message|>`): encoded, or without an
        encoding the markers' and NAME's own token; None where the encoding does not keep
        the markers as tokens, or NAME is no token."""
        channel, message = self.marker_ids[CHANNEL], self.marker_ids[MESSAGE]
        if encode is not None:
            ids = tuple(encode(header))
        else:
            name = header.removeprefix(CHANNEL).removesuffix(MESSAGE)
            ids = (channel, vocab[name], message) if name in vocab else ()
        if len(ids) < 3 or ids[0] != channel or ids[-1] != message:
            return None
        return ids

    def marker(self, token_id: int) -> str | None:
        return self._markers_by_id.get(token_id)

    def header_kind(self, header_ids: Sequence[int]) -> Kind:
        return message_kind("".join(self._token_text.get(t, "") for t in header_ids))

    def for_request(
        self, prompt_token_ids: Sequence[int], template_kwargs: Mapping[str, Any]
    ) -> HarmonyReasoning:
        ids = list(prompt_token_ids)
        start_id = self.marker_ids[START]
        if start_id not in ids:
            return HarmonyReasoning(self, in_reasoning=False)  # no harmony turn: all content
        turn = ids[len(ids) - ids[::-1].index(start_id) :]  # after the last <|start|>
        message_id = self.marker_ids[MESSAGE]
        if message_id not in turn:
            return HarmonyReasoning(self, in_reasoning=True)  # the template's `assistant`
        at = turn.index(message_id)
        if any(self.marker(t) in MESSAGE_ENDS for t in turn[at:]):
            return HarmonyReasoning(self, in_reasoning=True)  # closed: a header comes next
        if self.header_kind(turn[:at]) is Kind.REASONING:
            return HarmonyReasoning(self, in_reasoning=True, opens_in_analysis=True)
        return HarmonyReasoning(self, in_reasoning=False)


@dataclass(frozen=True)
class HarmonyReasoning(RequestReasoning):
    """One request's reading of harmony output. `in_reasoning`: the output starts before
    the answer (in a header, or in an analysis message the prompt opened); false: in the
    content (the prompt opened the answer, or a grammar holds the whole output)."""

    parser: GptOssReasoningParser
    opens_in_analysis: bool = False  # the prompt opened an analysis message

    @property
    def _first_kind(self) -> Kind | None:
        if not self.in_reasoning:
            return Kind.CONTENT
        return Kind.REASONING if self.opens_in_analysis else None

    def stream(self) -> HarmonyStream:
        return HarmonyStream(self._first_kind)

    def split(self, text: str) -> ReasoningSplit:
        reader = self.stream()
        fed, rest = reader.feed(text), reader.finish()
        reasoning, content = fed.reasoning + rest.reasoning, fed.content + rest.content
        return ReasoningSplit(reasoning or None, content or None)

    def token_counter(self) -> HarmonyTokens:
        return HarmonyTokens(self.parser, self._first_kind)


class HarmonyStream:
    """Reads one choice's harmony text as it grows: a header is held until its
    `<|message|>`; a message's text passes as its kind says, less an end that may be the
    start of a marker, held back until the next text says."""

    def __init__(self, kind: Kind | None) -> None:
        self._kind = kind  # the open message's; None: reading a header
        self._buffer = ""  # the header so far, or a message's text held back
        self._scanned = 0  # how much of a header held back holds no marker
        self._sent = {Kind.REASONING: False, Kind.CONTENT: False}  # some text of each kind
        self._new_message = False  # the open message has sent no text yet

    def feed(self, text: str) -> ReasoningDelta:
        text, self._buffer = self._buffer + text, ""
        out = {Kind.REASONING: [], Kind.CONTENT: []}
        while text:
            if self._kind is None:
                text = self._read_header(text, out)
            else:
                text = self._read_message(text, out)
        return ReasoningDelta("".join(out[Kind.REASONING]), "".join(out[Kind.CONTENT]))

    def finish(self) -> ReasoningDelta:
        """The text held back: a message's is its kind's (no marker after all); an
        unfinished header is dropped."""
        held, self._buffer = self._buffer, ""
        out = {Kind.REASONING: [], Kind.CONTENT: []}
        if self._kind is not None:
            self._send(held, out)
        return ReasoningDelta("".join(out[Kind.REASONING]), "".join(out[Kind.CONTENT]))

    def _read_header(self, text: str, out: dict[Kind, list[str]]) -> str:
        """Reads a header up to its `<|message|>`; returns the text after what it read."""
        scanned, self._scanned = self._scanned, 0
        at, marker = _first_marker(text, (START, MESSAGE, *MESSAGE_ENDS), scanned)
        if marker is None:
            self._buffer = text  # the header so far: nothing of it is sent
            self._scanned = max(0, len(text) - _LONGEST_MARKER + 1)
            return ""
        rest = text[at + len(marker) :]
        if marker != MESSAGE:
            return rest  # a new message begins, or one without text ended: a new header
        header = text[:at]
        self._kind, self._new_message = message_kind(header), True
        if self._kind is Kind.CALL:
            out[Kind.CONTENT].append(START + header + MESSAGE)
        return rest

    def _read_message(self, text: str, out: dict[Kind, list[str]]) -> str:
        """Reads a message's text up to a marker; returns the text after what it read."""
        at, marker = _first_marker(text, MARKERS)
        if marker is None:
            cut = len(text) - max(partial_suffix(text, m) for m in MARKERS)
            self._send(text[:cut], out)
            self._buffer = text[cut:]
            return ""
        self._send(text[:at], out)
        rest = text[at + len(marker) :]
        if marker == MESSAGE:
            return rest  # a stray one: the message goes on
        if self._kind is Kind.CALL and marker in MESSAGE_ENDS:
            out[Kind.CONTENT].append(marker)
        self._kind = None
        # A header without its <|start|> begins with its channel (or format).
        return marker + rest if marker in (CHANNEL, CONSTRAIN) else rest

    def _send(self, text: str, out: dict[Kind, list[str]]) -> None:
        if not text:
            return
        kind = self._kind
        assert kind is not None
        if kind is Kind.CALL:
            out[Kind.CONTENT].append(text)
            return
        if self._new_message and self._sent[kind]:
            text = "\n" + text  # a later message of its kind, on a line of its own
        self._new_message, self._sent[kind] = False, True
        out[kind].append(text)


def _first_marker(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str | None]:
    found = [(at, m) for m in markers if (at := text.find(m, start)) >= 0]
    return min(found) if found else (len(text), None)


class HarmonyTokens:
    """Counts one choice's output tokens that are reasoning (the text of its analysis
    messages), fed them as they come; `feed` also says how many of the new tokens, from
    the first, come before the content (the first other message's text)."""

    def __init__(self, parser: GptOssReasoningParser, kind: Kind | None) -> None:
        self.num_tokens = 0
        self._parser = parser
        self._kind = kind
        self._header: list[int] = []
        self._in_content = kind is Kind.CONTENT or kind is Kind.CALL

    def feed(self, token_ids: Sequence[int]) -> int:
        before_content = 0 if self._in_content else len(token_ids)
        for i, token_id in enumerate(token_ids):
            marker = self._parser.marker(token_id)
            if self._kind is None:  # a header
                if marker == MESSAGE:
                    self._kind = self._parser.header_kind(self._header)
                    if self._kind is not Kind.REASONING and not self._in_content:
                        self._in_content, before_content = True, i + 1
                elif marker == START or marker in MESSAGE_ENDS:
                    self._header = []
                else:
                    self._header.append(token_id)
            elif marker is None:
                if self._kind is Kind.REASONING:
                    self.num_tokens += 1
            elif marker != MESSAGE:
                self._kind = None
                self._header = [token_id] if marker in (CHANNEL, CONSTRAIN) else []
        return before_content
