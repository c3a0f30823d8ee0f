"""Logprobs in the OpenAI shapes the handlers share: the ranked alternatives of a
position, a token's text, and vLLM's `prompt_logprobs` field."""

from __future__ import annotations

from typing import Any

from serve.engine.detokenizer import text_decoder
from serve.outputs import RequestOutput


def ranked_alternatives(top: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    """The `num_top` most likely (token id, logprob) pairs of one position, best first."""
    return sorted(top.items(), key=lambda kv: kv[1], reverse=True)[:num_top]


def token_text(tokenizer: Any, token_id: int) -> str:
    return text_decoder(tokenizer)([token_id], False)


def prompt_logprobs_json(
    tokenizer: Any, out: RequestOutput, num_top: int
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token, null for the first, else
    {token id: {logprob, decoded_token}} for the prompt token and the `num_top` best."""
    if out.prompt_logprobs is None:
        return None
    result: list[dict[str, dict[str, Any]] | None] = []
    for token_id, top in zip(out.prompt_token_ids, out.prompt_logprobs):
        if top is None:
            result.append(None)
            continue
        entries = dict(ranked_alternatives(top, num_top))
        entries[token_id] = top[token_id]
        result.append(
            {
                str(t): {"logprob": lp, "decoded_token": token_text(tokenizer, t)}
                for t, lp in entries.items()
            }
        )
    return result
