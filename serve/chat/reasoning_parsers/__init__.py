"""Reasoning parsers by name (`--reasoning-parser NAME`)."""

from __future__ import annotations

from collections.abc import Mapping

from serve.chat.reasoning_parsers.base import (
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


def get_reasoning_parser(name: str, vocab: Mapping[str, int]) -> ReasoningParser:
    """The parser `name` over a tokenizer's vocabulary (`get_vocab()`); ValueError for an
    unknown name, or a vocabulary the parser cannot read the markers in."""
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"Unknown reasoning parser {name!r}; choose from {sorted(REASONING_PARSERS)}."
        )
    return REASONING_PARSERS[name](vocab)


__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningSplit",
    "ReasoningStream",
    "ReasoningTokens",
    "RequestReasoning",
    "get_reasoning_parser",
]
