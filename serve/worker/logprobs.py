"""Log-probabilities of given tokens (the prompt's, for `prompt_logprobs`), their ranks and
their top-k alternatives, under the model's own distribution."""

from __future__ import annotations

import torch


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: int
) -> tuple[list[dict[int, float]], list[int]]:
    """Per row of `logits` [rows, vocab]: {token id: logprob} holding `token_ids[row]` and
    the `num_top` most likely tokens; and `token_ids[row]`'s rank as vLLM counts it, the
    tokens whose logprob is at least its own, itself included (1: the most likely)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(token_ids, device=logits.device)[:, None]
    chosen = logprobs.gather(1, targets)  # [rows, 1]
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    entries: list[dict[int, float]] = [{} for _ in token_ids]
    if num_top:
        top = logprobs.topk(num_top, dim=-1)
        for entry, ids, values in zip(entries, top.indices.tolist(), top.values.tolist()):
            entry.update(zip(ids, values))
    for entry, token, logprob in zip(entries, token_ids, chosen.squeeze(1).tolist()):
        entry[token] = logprob
    return entries, ranks
