"""DeepSeek's reasoning: `<think>…</think>` before the answer.

deepseek_r1 (DeepSeek-R1 and its distills, QwQ): the chat template of newer releases ends
the prompt with `<think>\\n`, so the output starts inside the reasoning without a start
marker; everything before `</think>` is reasoning, and an output without it is all
reasoning. As vLLM does, the markers must be tokens of the tokenizer.

deepseek_v3 (DeepSeek-V3.1 and later): the same, when the template is asked to think
(`thinking` or `enable_thinking` true in chat_template_kwargs); otherwise the output is
all content.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from serve.chat.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    needs_marker_tokens = True


class DeepSeekV3ReasoningParser(ReasoningParser):
    name = "deepseek_v3"

    def thinks(self, template_kwargs: Mapping[str, Any]) -> bool:
        return bool(template_kwargs.get("thinking")) or bool(template_kwargs.get("enable_thinking"))
