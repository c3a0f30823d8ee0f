"""Reasoning parsers by name (`--reasoning-parser NAME`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from serve.chat.reasoning_parsers.base import (
    Encode,
    ReasoningDelta,
    ReasoningParser,
    ReasoningSplit,
    ReasoningStream,
    ReasoningTokens,
    RequestReasoning,
)
from serve.chat.reasoning_parsers.deepseek import (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
)
from serve.chat.reasoning_parsers.gpt_oss import GptOssReasoningParser
from serve.chat.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser
    for parser in (
        DeepSeekR1ReasoningParser,
        DeepSeekV3ReasoningParser,
        GptOssReasoningParser,
        Qwen3ReasoningParser,
    )
}


def get_reasoning_parser(
    name: str, vocab: Mapping[str, int], encode: Encode | None = None
) -> ReasoningParser:
    """The parser `name` over a tokenizer's vocabulary (`get_vocab()`) and encoding
    (`encode`: the ids of a text, its special tokens read as tokens; GPT-OSS's parser finds
    its final message's header with it); ValueError for an unknown name, or a vocabulary
    the parser cannot read the markers in."""
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"Unknown reasoning parser {name!r}; choose from {sorted(REASONING_PARSERS)}."
        )
    return REASONING_PARSERS[name](vocab, encode)


def reasoning_parser_for(name: str, tokenizer: Any) -> ReasoningParser:
    """`get_reasoning_parser` over a Hugging Face tokenizer's vocabulary and encoding."""
    return get_reasoning_parser(
        name,
        tokenizer.get_vocab(),
        lambda text: tokenizer.encode(text, add_special_tokens=False),
    )


__all__ = [
    "Encode",
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningSplit",
    "ReasoningStream",
    "ReasoningTokens",
    "RequestReasoning",
    "get_reasoning_parser",
    "reasoning_parser_for",
]
