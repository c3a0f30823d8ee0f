"""Incremental detokenization and stop strings.

Decoding only the newest token is wrong for byte-level and sentencepiece vocabularies: a
token can carry half of a UTF-8 character, or its leading space depends on its left
neighbour. So each step decodes a short window `tokens[prefix_offset:]` and emits what it
adds beyond `tokens[prefix_offset:read_offset]`, holding back text that ends in an
incomplete character (U+FFFD) until the next token completes it.
"""

from __future__ import annotations

from typing import Any

from serve.sequence import Sequence

# Prompt tokens kept as left context for the first output token's decoding.
_INITIAL_CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 byte tokens.
_MAX_CHAR_TOKENS = 4


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        seq.read_offset = seq.num_prompt_tokens
        seq.prefix_offset = self._initial_prefix_offset(seq)

    def _initial_prefix_offset(self, seq: Sequence) -> int:
        """`_INITIAL_CONTEXT_TOKENS` before the output, moved left onto a character boundary.

        A window that opens inside a character decodes its tail as U+FFFD, and byte-fallback
        decoders (sentencepiece `<0xNN>` tokens) replace the whole run of byte tokens then,
        so the output's first characters would come out as U+FFFD too.
        """
        prompt = seq.prompt_token_ids
        skip = seq.sampling_params.skip_special_tokens
        offset = max(len(prompt) - _INITIAL_CONTEXT_TOKENS, 0)
        for start in range(offset, max(offset - _MAX_CHAR_TOKENS, -1), -1):
            window_text = self.tokenizer.decode(prompt[start:], skip_special_tokens=skip)
            if not window_text.startswith("\ufffd"):
                return start
        return offset

    def update(self, seq: Sequence) -> str:
        """Decode the newest output token(s) into `seq.output_text`; returns the new text."""
        tokens = seq.token_ids_between(seq.prefix_offset)
        read = seq.read_offset - seq.prefix_offset
        skip = seq.sampling_params.skip_special_tokens
        prefix_text = self.tokenizer.decode(tokens[:read], skip_special_tokens=skip)
        full_text = self.tokenizer.decode(tokens, skip_special_tokens=skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # nothing printable yet: wait for the next token
        delta = full_text[len(prefix_text) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = seq.num_tokens
        seq.output_text += delta
        return delta


def find_stop_string(seq: Sequence, num_new_chars: int) -> bool:
    """Truncate `seq.output_text` at the first stop string that the newest `num_new_chars`
    characters completed; record it as the stop reason. Returns whether one was found."""
    stops = seq.sampling_params.stop_strings
    if not stops or not num_new_chars:
        return False
    text = seq.output_text
    matches = []
    for stop in stops:
        # Only a match ending in the new text is new; start the search early enough for it.
        index = text.find(stop, max(len(text) - num_new_chars - len(stop) + 1, 0))
        if index != -1:
            matches.append((index, stop))
    if not matches:
        return False
    index, stop = min(matches)
    keep = index + len(stop) if seq.sampling_params.include_stop_str_in_output else index
    seq.output_text = text[:keep]
    seq.stop_reason = stop
    return True
