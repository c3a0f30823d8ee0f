"""Starting engine work for a request: prompts rendered and tokenized on one thread off
the event loop, and one engine request per prompt, its sampling parameters checked first
(a 400 naming the field) and the request logged where the server logs them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from serve.api.errors import APIError
from serve.api.protocol import SamplingRequest
from serve.api.settings import ServerSettings
from serve.engine.protocol import EngineClient
from serve.lora_request import LoRARequest
from serve.multimodal_inputs import MultiModalInput
from serve.outputs import OutputKind, RequestOutput

T = TypeVar("T")


# Rendering and tokenizing prompts run here, off the event loop (a long prompt takes
# seconds, and would stall every stream), on one thread: HF fast tokenizers are not safe
# to call from several threads at once.
_PROMPT_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="api-prompt")


async def off_the_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the prompt thread."""
    return await asyncio.get_running_loop().run_in_executor(_PROMPT_THREAD, fn, *args)


def open_stream(
    engine: EngineClient,
    settings: ServerSettings,
    request: SamplingRequest,
    request_id: str,
    prompt_token_ids: list[int],
    prompt: str | None,
    max_tokens: int,
    num_logprobs: int | None,
    output_kind: OutputKind = OutputKind.DELTA,
    *,
    grammar_start_token_ids: tuple[int, ...] = (),
    lora_request: LoRARequest | None = None,
    mm_inputs: tuple[MultiModalInput, ...] = (),
) -> AsyncGenerator[RequestOutput, None]:
    """One engine request for a prompt's `n` choices, which share the prompt's KV blocks;
    it is stopped with RequestTimeoutError after the server's `--request-timeout`. It
    gives what is new at each step (DELTA, a streamed response's), or the finished output
    alone (FINAL_ONLY). The fields the request leaves out take the model's sampling
    defaults; the request is logged as it goes in (`--enable-log-requests`). Its grammar,
    if any, starts after the output completes `grammar_start_token_ids`, a token sequence
    (`request_checks.grammar_start`).
    `lora_request`: the adapter it runs with (`ServedModels.resolve`), None for the base;
    `mm_inputs`: its prompt's images, processed (`engine/multimodal.py`)."""
    try:
        params = request.sampling_params(max_tokens, num_logprobs, settings.sampling_defaults)
        if grammar_start_token_ids and params.structured_outputs is not None:
            params.structured_outputs = dataclasses.replace(
                params.structured_outputs, start_after_token_ids=grammar_start_token_ids
            )
        engine.check_params(params)
    except ValueError as e:
        raise APIError(400, str(e), param=_param_named(str(e), request)) from None
    settings.request_log.log(request_id, prompt, prompt_token_ids, params, lora_request)
    return engine.generate(
        request_id,
        prompt_token_ids,
        params,
        prompt,
        settings.request_timeout_s,
        priority=request.priority,
        output_kind=output_kind,
        lora_request=lora_request,
        mm_inputs=mm_inputs,
    )


def _param_named(message: str, request: SamplingRequest) -> str | None:
    """The request field an engine-side message starts with (they all do), if it is one."""
    first = message.split(" ", 1)[0]
    fields = type(request).model_fields
    if first == "logprobs" and "top_logprobs" in fields:
        return "top_logprobs"  # chat's count of alternatives; its `logprobs` is a switch
    return first if first in fields else None
