"""--enable-log-requests: one INFO line per engine request, as it is handed to the engine.

The line carries the engine's request id, the prompt (its text where the server has it,
and its token ids, each cut to `--max-log-len`) and the parameters the engine runs it
with, in vLLM's words ("Received request ...: prompt: ..., params: ..."). It is given only
what the engine is given: never the HTTP request, so never its headers or API key.
Without the flag nothing of a request's content is logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from serve.lora_request import LoRARequest
from serve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestLog:
    enabled: bool = False
    max_log_len: int | None = None  # prompt characters and token ids logged; None: all

    def log(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Log one engine request (a choice set of a completion prompt, an embedding
        input), with its adapter as vLLM logs it. An embedding's params are its pooling's,
        as vLLM logs PoolingParams."""
        if not self.enabled or not logger.isEnabledFor(logging.INFO):
            return
        if self.max_log_len is not None:
            prompt = prompt[: self.max_log_len] if prompt is not None else None
            prompt_token_ids = prompt_token_ids[: self.max_log_len]
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s.",
            request_id,
            prompt,
            params.pooling if params.pooling is not None else params,
            prompt_token_ids,
            lora_request,
        )
