"""Qwen3's reasoning: `<think>…</think>` before the answer, unless the chat template was
asked not to think (`enable_thinking` false in chat_template_kwargs: the output is then
all content). The output starts inside the reasoning; an output without `</think>` is all
reasoning. A tool call written while still thinking (`<tool_call>`) ends the reasoning and
is content, as vLLM's qwen3 parser reads it. The prompt is read back to its last ChatML
turn boundary for a marker that already ended the reasoning."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from serve.chat.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    implicit_ends = ("<tool_call>",)
    turn_boundaries = ("<|im_start|>", "<|im_end|>")

    def thinks(self, template_kwargs: Mapping[str, Any]) -> bool:
        return bool(template_kwargs.get("enable_thinking", True))
