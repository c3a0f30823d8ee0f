"""Incremental detokenization and stop strings, for the front end (output_processor.py).

Decoding only the newest token is wrong for byte-level and sentencepiece vocabularies: a
token can carry half of a UTF-8 character, or its leading space depends on its left
neighbour. So each update decodes a short window `tokens[prefix_offset:]` and emits what
it adds beyond `tokens[prefix_offset:read_offset]`, holding back text that ends in an
incomplete character (U+FFFD) until the next token completes it.

Offsets count tokens of the whole sequence, prompt then output:

    prompt ............ | output ..........................
              ^ prefix_offset     ^ read_offset         ^ number of tokens
              |-- decoded already, left context --|-- new --|
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import tokenizers

# Prompt tokens kept as left context for the first output token's decoding.
_INITIAL_CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 byte tokens.
MAX_CHAR_TOKENS = 4
REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are no whole character


TextDecoder = Callable[[list[int], bool], str]  # (token ids, skip special tokens) -> text
_decoders: weakref.WeakKeyDictionary[Any, TextDecoder] = weakref.WeakKeyDictionary()


def text_decoder(tokenizer: Any) -> TextDecoder:
    """`tokenizer.decode`, or, where the two give the same text, the Rust tokenizer's own
    decode under it: a fast tokenizer that cleans up no spaces. transformers' wrapper costs
    ~3x the decode itself, and the front end decodes twice per sequence per token."""
    try:
        return _decoders[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", True
    ):

        def decode(token_ids: list[int], skip: bool) -> str:
            return backend.decode(token_ids, skip_special_tokens=skip)

    else:

        def decode(token_ids: list[int], skip: bool) -> str:
            return tokenizer.decode(token_ids, skip_special_tokens=skip)

    try:
        _decoders[tokenizer] = decode
    except TypeError:  # not weakly referenceable: decided again next time
        pass
    return decode


def token_text_in_context(decode: TextDecoder, token_id: int, context: list[int]) -> str:
    """A token's text as vLLM labels it in logprobs: decoded alone, unless that ends in
    U+FFFD (the token holds a piece of a character split over several tokens). Then it is
    read after the tokens before it in the sequence (`context`, oldest first; the last 4
    matter): "" while the character is incomplete, and on the token that completes it the
    whole character (with what else the token adds). Any other token is what it adds
    after the token before it (its leading space, which a sentencepiece token decoded
    alone drops). So a sequence's labels join to its text, where each piece alone would
    be a U+FFFD of its own."""
    text = decode([token_id], False)
    if not text.endswith(REPLACEMENT):
        if not context:
            return text
        # What the token adds after the ones before it: a sentencepiece (Metaspace) token
        # decoded alone loses its leading space, which it writes after a neighbour.
        # The shortest window before it that ends on a whole character.
        for size in range(1, min(len(context), MAX_CHAR_TOKENS) + 1):
            window = context[-size:]
            before = decode(window, False)
            if before.endswith(REPLACEMENT):
                continue
            after = decode([*window, token_id], False)
            return after[len(before) :] if after.startswith(before) else text
        return text
    context = context[-MAX_CHAR_TOKENS:]
    for start in range(len(context) - 1, -1, -1):  # one token of context, then more
        window = context[start:]
        whole = decode([*window, token_id], False)
        if whole.endswith(REPLACEMENT):
            continue
        # The window's trailing pieces of the character were labelled "" when their turn
        # came: their text belongs to this token, after the window's whole characters.
        clean = len(window)
        while clean > 0 and decode([window[clean - 1]], False).endswith(REPLACEMENT):
            clean -= 1
        prefix = decode(window[:clean], False) if clean else ""
        return whole[len(os.path.commonprefix([prefix, whole])) :]
    return ""


class IncrementalDetokenizer:
    """One sequence's text, decoded as its output tokens arrive. It holds no tokens of its
    own: each update reads the output list its caller keeps (appended to, never changed)."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.decode = text_decoder(tokenizer)
        self.prompt_token_ids = prompt_token_ids  # shared with the request; never changed
        self.skip_special_tokens = skip_special_tokens
        # Set on the first update, so that a tokenizer fault there fails its request in the
        # output processor's per-request scope like any other decoding fault.
        self.prefix_offset: int | None = None
        self.read_offset = len(prompt_token_ids)

    def update(self, output_token_ids: list[int]) -> str:
        """The text that the output's newest token(s) add ("" while it is incomplete)."""
        if self.prefix_offset is None:
            self.prefix_offset = initial_prefix_offset(
                self.decode, self.prompt_token_ids, self.skip_special_tokens
            )
        num_prompt = len(self.prompt_token_ids)
        start = self.prefix_offset
        window = self.prompt_token_ids[start:] + output_token_ids[max(start - num_prompt, 0) :]
        read = self.read_offset - start
        prefix_text = self.decode(window[:read], self.skip_special_tokens)
        full_text = self.decode(window, self.skip_special_tokens)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # nothing printable yet: wait for the next token
        self.prefix_offset = self.read_offset
        self.read_offset = num_prompt + len(output_token_ids)
        return full_text[len(prefix_text) :]


def initial_prefix_offset(decode: TextDecoder, prompt_token_ids: list[int], skip: bool) -> int:
    """`_INITIAL_CONTEXT_TOKENS` before the output, moved left onto a character boundary.

    A window that opens inside a character decodes its tail as U+FFFD, and byte-fallback
    decoders (sentencepiece `<0xNN>` tokens) replace the whole run of byte tokens then,
    so the output's first characters would come out as U+FFFD too.
    """
    offset = max(len(prompt_token_ids) - _INITIAL_CONTEXT_TOKENS, 0)
    for start in range(offset, max(offset - MAX_CHAR_TOKENS, -1), -1):
        window_text = decode(prompt_token_ids[start:], skip)
        if not window_text.startswith("\ufffd"):
            return start
    return offset


def find_stop_string(
    text: str, num_new_chars: int, stops: list[str], include_stop: bool
) -> tuple[int, str] | None:
    """The stop string that the newest `num_new_chars` characters of `text` completed
    first (the match that ends earliest, as text growing a character at a time would
    meet it; ties to the earlier in `stops`, as vLLM), and how much of `text` to keep (up
    to the stop, or through it with `include_stop`); None when they complete none."""
    if not stops or not num_new_chars:
        return None
    matches = []
    for order, stop in enumerate(stops):
        # Only a match ending in the new text is new; start the search early enough for it.
        index = text.find(stop, max(len(text) - num_new_chars - len(stop) + 1, 0))
        if index != -1:
            matches.append((index + len(stop), order, index, stop))
    if not matches:
        return None
    _, _, index, stop = min(matches)
    return (index + len(stop) if include_stop else index), stop
