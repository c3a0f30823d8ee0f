"""Where a grammar that waits starts: after a token sequence
(`StructuredOutputsParams.start_after_token_ids`), the end of a reasoning model's thinking:
one token (`</think>`) or several (GPT-OSS's `<|channel|>final<|message|>`).

The grammar starts after the first output token that completes the sequence: the tokens
(prompt, then output) end with all of it, in order. A match may begin in the prompt's last
tokens (a prompt cut inside the sequence) but ends in the output; a partial match that a
token breaks falls back to the longest one still standing (`…<|channel|>analysis…` holds
nothing of the sequence, `<|channel|><|channel|>final<|message|>` completes it).

The state is a count: how many of the sequence's first tokens the tokens end with (the
longest such run, short of the whole). It is a function of the last `len - 1` tokens
alone, so every rank finds it from its mirror (`GrammarStart.after`, for speculation's cut)
as the driver keeps it token by token (`advance`, for the sampler's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GrammarStart:
    """How far the tokens so far have gone into the sequence a grammar starts after."""

    token_ids: tuple[int, ...]  # the sequence: at least one token
    num_matched: int = 0  # the tokens end with token_ids[:num_matched] (< len(token_ids))

    @classmethod
    def after(cls, token_ids: tuple[int, ...], tokens: Sequence[int]) -> GrammarStart:
        """The state after `tokens` (their last len - 1 are read; too few to hold the
        whole sequence, so it is never complete there)."""
        state = cls(token_ids)
        for token in tokens[max(0, len(tokens) - len(token_ids) + 1) :]:
            advanced = state.advance(token)
            assert advanced is not None  # fewer tokens than the sequence has
            state = advanced
        return state

    def advance(self, token: int) -> GrammarStart | None:
        """The state after one more token; None: it completed the sequence (the grammar
        starts with the next token)."""
        # The longest run of the sequence's first tokens that the tokens now end with lies
        # in the run matched so far and this token.
        window = (*self.token_ids[: self.num_matched], token)
        for length in range(len(window), 0, -1):
            if window[len(window) - length :] == self.token_ids[:length]:
                if length == len(self.token_ids):
                    return None
                return GrammarStart(self.token_ids, length)
        return GrammarStart(self.token_ids)

    def completed_at(self, token_ids: Sequence[int]) -> int | None:
        """The index of the first of `token_ids` (following the tokens so far) that
        completes the sequence; None if none does."""
        state = self
        for i, token in enumerate(token_ids):
            advanced = state.advance(token)
            if advanced is None:
                return i
            state = advanced
        return None
