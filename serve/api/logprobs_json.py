"""Logprobs in the OpenAI shapes the handlers share: the ranked alternatives of a
position, a token's text, and vLLM's `prompt_logprobs` field."""

from __future__ import annotations

import json
import re
import weakref
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

from serve.engine.detokenizer import MAX_CHAR_TOKENS, text_decoder, token_text_in_context
from serve.outputs import RequestOutput


def ranked_alternatives(top: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    """The `num_top` most likely (token id, logprob) pairs of one position, best first."""
    return sorted(top.items(), key=lambda kv: kv[1], reverse=True)[:num_top]


def token_text(tokenizer: Any, token_id: int) -> str:
    return text_decoder(tokenizer)([token_id], False)


def token_label(
    tokenizer: Any, token_id: int, as_id: bool, context: list[int] | None = None
) -> str:
    """A logprobs entry's `token`: its text, or with vLLM's `return_tokens_as_token_ids`
    "token_id:N", which names a token even where texts collide or a byte is split. Given
    the tokens before it (`context`), a piece of a split character reads as vLLM labels
    it (`token_text_in_context`: "", or the whole character on the piece that ends it)."""
    if as_id:
        return f"token_id:{token_id}"
    if context is None:
        return token_text(tokenizer, token_id)
    return token_text_in_context(text_decoder(tokenizer), token_id, context)


def token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """OpenAI's `bytes` of a token whose text is `text`: its UTF-8, or, for a token that
    holds part of a character (its text U+FFFD), the bytes it holds, which joined with its
    neighbours' spell the character. Those come from the token's piece where the
    tokenizer says them: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) or a sentencepiece
    byte token (`<0xE2>`)."""
    if "\ufffd" in text:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            byte_token = _BYTE_TOKEN.fullmatch(piece)
            if byte_token:
                return [int(byte_token.group(1), 16)]
            if _is_byte_level(tokenizer) and all(c in _BYTE_OF_CHAR for c in piece):
                return [_BYTE_OF_CHAR[c] for c in piece]
    return list(text.encode("utf-8"))


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}
_byte_level: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's pieces are byte-level BPE's (its decoder maps them back)."""
    try:
        return _byte_level[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    kinds = [decoder, *decoder.get("decoders", [])] if isinstance(decoder, dict) else []
    is_byte_level = any(d.get("type") == "ByteLevel" for d in kinds if isinstance(d, dict))
    try:
        _byte_level[tokenizer] = is_byte_level
    except TypeError:
        pass
    return is_byte_level


def prompt_logprobs_json(
    tokenizer: Any, out: RequestOutput, num_top: int
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token, null for the first, else
    {token id: {logprob, rank, decoded_token}} for the prompt token (outside the best: its
    rank under the model), then the `num_top` best (ranked by their order). Each
    `decoded_token` is read after the prompt tokens before it (`token_label`)."""
    if out.prompt_logprobs is None:
        return None
    prompt_ids = out.prompt_token_ids
    prompt_ranks = out.prompt_ranks or [None] * len(out.prompt_logprobs)
    result: list[dict[str, dict[str, Any]] | None] = []
    for position, (token_id, top, rank) in enumerate(
        zip(prompt_ids, out.prompt_logprobs, prompt_ranks)
    ):
        if top is None:
            result.append(None)
            continue
        # The prompt token first, then the best in order, as vLLM lists them; its rank is
        # its place among them where it is one of them.
        entries = {token_id: (top[token_id], rank)}
        for i, (t, lp) in enumerate(ranked_alternatives(top, num_top)):
            entries[t] = (lp, i + 1)
        context = prompt_ids[max(0, position - MAX_CHAR_TOKENS) : position]
        result.append(
            {
                str(t): {
                    "logprob": lp,
                    "rank": r,
                    "decoded_token": token_label(tokenizer, t, False, context),
                }
                for t, (lp, r) in entries.items()
            }
        )
    return result
