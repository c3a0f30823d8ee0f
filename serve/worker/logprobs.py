"""Log-probabilities of given tokens (the prompt's, for `prompt_logprobs`), their ranks and
their top-k alternatives, under the model's own distribution."""

from __future__ import annotations

import torch

# Rows converted to float32 at a time. A prompt chunk's rows at once (8,192 of a 128k
# vocabulary: 4 GiB of float32 log-probabilities, the model-dtype logits and a comparison
# beside them) outgrew what the start-up profile leaves free on a GPU, which sized the
# cache for the logits alone.
ROWS_AT_A_TIME = 256


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: int
) -> tuple[list[dict[int, float]], list[int]]:
    """Per row of `logits` [rows, vocab] (any float dtype): {token id: logprob} holding
    `token_ids[row]` and the `num_top` most likely tokens; and `token_ids[row]`'s rank as
    vLLM counts it, the tokens whose logprob is at least its own, itself included (1: the
    most likely)."""
    entries: list[dict[int, float]] = []
    ranks: list[int] = []
    targets = torch.tensor(token_ids, device=logits.device)[:, None]
    for start in range(0, len(token_ids), ROWS_AT_A_TIME):
        stop = min(start + ROWS_AT_A_TIME, len(token_ids))
        logprobs = torch.log_softmax(logits[start:stop].float(), dim=-1)
        chosen = logprobs.gather(1, targets[start:stop])  # [rows, 1]
        ranks += (logprobs >= chosen).sum(dim=-1).tolist()
        rows: list[dict[int, float]] = [{} for _ in range(start, stop)]
        if num_top:
            top = logprobs.topk(num_top, dim=-1)
            for entry, ids, values in zip(rows, top.indices.tolist(), top.values.tolist()):
                entry.update(zip(ids, values))
        for entry, token, logprob in zip(rows, token_ids[start:stop], chosen[:, 0].tolist()):
            entry[token] = logprob
        entries += rows
    return entries, ranks
