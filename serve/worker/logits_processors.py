"""Per-request logits controls as batched tensor ops: pure functions of tensors.

Each function edits float32 logits `[num_seqs, vocab]` in place and touches only the rows
its index tensors name. Token sets are given as coordinates: `rows[i]`, `token_ids[i]` is
one (row, token) pair, so a ragged list of per-row token ids becomes two flat tensors
(`coordinates`) and one indexing op covers the whole batch. The sampler decides which rows
use a control and calls these; a control nobody uses is never called.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def coordinates(
    rows: Sequence[int], token_ids: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat (row, token) index tensors of `token_ids[j]` in row `rows[j]`."""
    lengths = torch.tensor([len(ids) for ids in token_ids], device=device)
    row_index = torch.tensor(rows, device=device).repeat_interleave(lengths)  # [n]
    flat = [t for ids in token_ids for t in ids]
    return row_index, torch.tensor(flat, dtype=torch.long, device=device)  # [n], [n]


def ban_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """`logits[rows[i], token_ids[i]] = -inf` for every i."""
    logits.index_put_((rows, token_ids), torch.tensor(float("-inf"), device=logits.device))


def keep_only_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """In each row named in `rows`, every token not paired with that row becomes -inf."""
    kept = logits[rows, token_ids]  # [n]
    logits.index_fill_(0, rows, float("-inf"))  # a row named twice is filled twice: harmless
    logits.index_put_((rows, token_ids), kept)


def add_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor
) -> None:
    """`logits[rows[i], token_ids[i]] += bias[i]` for every i."""
    logits.index_put_((rows, token_ids), bias, accumulate=True)


def count_tokens(
    rows: torch.Tensor, token_ids: torch.Tensor, num_rows: int, vocab_size: int
) -> torch.Tensor:
    """How often each token occurs in each row, `[num_rows, vocab_size]` float32; `rows`
    index the result (0 <= rows < num_rows), not the batch."""
    counts = torch.zeros(num_rows * vocab_size, device=token_ids.device)
    ones = torch.ones(token_ids.shape[0], device=token_ids.device)
    counts.scatter_add_(0, rows * vocab_size + token_ids, ones)
    return counts.view(num_rows, vocab_size)


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_counts: torch.Tensor | None,
    penalties: torch.Tensor,
) -> None:
    """OpenAI's presence and frequency penalties and HF's repetition penalty, in vLLM's order.

    rows: [m] the batch rows penalised. output_counts: [m, vocab] occurrences of each token
    in the row's output so far. prompt_counts: [m, vocab] in its prompt, needed only for
    the repetition penalty (None: no row has one). penalties: [m, 3] (repetition,
    frequency, presence) per row.

    A token seen in prompt or output has a positive logit divided by the repetition
    penalty and a negative one multiplied by it; then `frequency * count` and `presence`
    (once, if the token is in the output) are subtracted.
    """
    repetition, frequency, presence = penalties.unbind(dim=1)  # [m] each
    sub = logits.index_select(0, rows)  # [m, vocab]
    in_output = output_counts > 0  # [m, vocab]
    if prompt_counts is not None:
        seen = in_output | (prompt_counts > 0)
        scale = torch.where(seen, repetition[:, None], 1.0)  # [m, vocab]
        sub = torch.where(sub > 0, sub / scale, sub * scale)
    sub -= frequency[:, None] * output_counts
    sub -= presence[:, None] * in_output
    logits.index_copy_(0, rows, sub)


def banned_by_bad_words(words: Sequence[Sequence[int]], output_token_ids: list[int]) -> list[int]:
    """The next tokens that would complete one of `words` (token-id sequences): a word's
    last token, when the output ends with the word's other tokens (always, for a one-token
    word)."""
    banned = []
    num_output = len(output_token_ids)
    for word in words:
        num_prefix = len(word) - 1
        if num_prefix == 0 or (
            num_prefix <= num_output
            and output_token_ids[num_output - num_prefix :] == list(word[:-1])
        ):
            banned.append(word[-1])
    return banned
