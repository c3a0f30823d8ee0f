"""Whether a request may start, decided before any engine work: the server's limits and the
scheduling policy (400s naming the flag), the context window (by
characters before tokenizing, by tokens after), and the request's grammar compiled within
its deadline (and, with --reasoning-parser, where it starts)."""

from __future__ import annotations

import asyncio
from typing import Any

from serve.api.errors import APIError
from serve.api.protocol import FORMAT_FIELDS, CompletionRequest, SamplingRequest
from serve.api.settings import ServerSettings
from serve.chat.reasoning_parsers import RequestReasoning
from serve.engine.offline_inputs import truncated_prompt
from serve.engine.protocol import EngineClient
from serve.engine.validation import check_priority
from serve.sampling_params import StructuredOutputsParams


def check_limits(request: SamplingRequest, settings: ServerSettings) -> None:
    """A 400 naming the flag for a request that asks for more than this server allows,
    or for a `priority` it does not schedule by. Cheap: checked before the prompt is
    tokenized."""
    try:
        check_priority(request.priority, settings.scheduling_policy)
    except ValueError as e:
        raise APIError(400, str(e), param="priority") from None
    limits = settings.limits
    for name, value in (("n", request.n), ("best_of", request.best_of)):
        if value is not None and value > limits.max_n:
            raise APIError(
                400,
                f"{name} is {value}; this server allows at most {limits.max_n} (--max-n).",
                param=name,
            )
    stop_lists = {
        "stop": request.stop if isinstance(request.stop, list) else None,
        "stop_token_ids": request.stop_token_ids,
        "bad_words": request.bad_words,
    }
    for name, entries in stop_lists.items():
        _check_num_entries(name, entries, limits.max_stop_sequences, "--max-stop-sequences")
    _check_num_entries("logit_bias", request.logit_bias, limits.max_logit_bias, "--max-logit-bias")


def truncate_prompt(
    ids: list[int],
    keep: int | None,
    max_model_len: int,
    is_prefill_only: bool = False,
    is_pooling: bool = False,
) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens, an embedding's
    first (-1: as many as the context holds beside one output token; all of it for a
    prefill-only request); None: the prompt as it is. The offline `LLM` cuts alike."""
    if keep is not None and (keep == 0 or keep > max_model_len):
        raise APIError(
            400,
            f"truncate_prompt_tokens must be -1 (the context, {max_model_len} tokens) or "
            f"from 1 to {max_model_len}; got {keep}.",
            param="truncate_prompt_tokens",
        )
    return truncated_prompt(ids, keep, max_model_len, is_prefill_only, is_pooling)


def fit_prompt(
    text: str,
    ids: list[int],
    request: SamplingRequest,
    tokenizer: Any,
    max_model_len: int,
    settings: ServerSettings,
) -> tuple[str, list[int], int]:
    """A prompt cut to the request's `truncate_prompt_tokens` (its text decoded from what
    is kept), and its completion budget (`resolve_max_tokens`, with the generation
    config's default and cap from `settings`)."""
    requested = request.requested_max_tokens
    prefill_only = requested == 0  # completions' echo scoring
    kept = truncate_prompt(ids, request.truncate_prompt_tokens, max_model_len, prefill_only)
    if len(kept) < len(ids):
        text, ids = tokenizer.decode(kept), kept
    check_context(len(ids), requested, max_model_len, request)
    default = settings.sampling_defaults.get("max_tokens")
    budget = resolve_max_tokens(
        len(ids), requested, max_model_len, default, settings.max_tokens_cap
    )
    return text, ids, budget


def check_context(
    prompt_len: int, requested: int | None, max_model_len: int, request: SamplingRequest
) -> None:
    """A 400 in OpenAI's words where vLLM refuses what the context cannot hold: a
    max_tokens larger than the whole context, or a prompt that leaves no room for one
    token of output (for completions' echo scoring, max_tokens 0: one longer than the
    context). A prompt and max_tokens that together overflow it are not refused: the
    budget shrinks to fit (`resolve_max_tokens`)."""
    if requested is not None and requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion). Please reduce the length of the prompt or the "
            "completion.",
            param=_max_tokens_param(request),
            code="context_length_exceeded",
        )
    if prompt_len + (0 if requested == 0 else 1) > max_model_len:
        noun = "prompt" if isinstance(request, CompletionRequest) else "messages"
        room = "" if requested == 0 else ", which leaves no room for the completion"
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{noun} resulted in {prompt_len} tokens{room}. Please reduce the length of the "
            f"{noun}.",
            param=noun,
            code="context_length_exceeded",
        )


def resolve_max_tokens(
    prompt_len: int,
    requested: int | None,
    max_model_len: int,
    default: int | None = None,
    cap: int | None = None,
) -> int:
    """The completion budget, as vLLM's `get_max_tokens` finds it: what the request asks
    for (None: the generation config's `default`, else all the room left), bounded by the
    room the context leaves beside the prompt and by `cap`. A request past the room runs
    to it and ends with finish_reason "length". `check_context` first."""
    asked = requested if requested is not None else default
    room = max_model_len - prompt_len
    return min(value for value in (room, asked, cap) if value is not None)


def _max_tokens_param(request: SamplingRequest) -> str:
    """The field that set the budget: chat's max_completion_tokens wins over max_tokens."""
    return (
        "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
    )


def check_no_streamed_prompt_logprobs(request: SamplingRequest) -> None:
    """A 400 for vLLM's `prompt_logprobs` on a streamed response, which has no place for
    them (vLLM refuses them there too)."""
    if request.prompt_logprobs is not None:
        raise APIError(
            400,
            "prompt_logprobs are not available when streaming; set stream to false.",
            param="prompt_logprobs",
        )


def grammar_start(reasoning: RequestReasoning | None, request: SamplingRequest) -> tuple[int, ...]:
    """The token sequence after which the request's grammar starts (none: from its first
    token). With --reasoning-parser, as vLLM decides: after the reasoning's end (`</think>`;
    GPT-OSS's final message header, several tokens) while the output starts in the
    reasoning (`reasoning.in_reasoning`: not when the prompt ended it already, the template
    was asked not to think, or chat's include_reasoning false holds a constrained output
    from its first token). A 400 where no tokens mark the end."""
    if reasoning is None:
        return ()
    if not reasoning.can_start_grammar and request.structured_outputs_params() is not None:
        parser = reasoning.parser
        raise APIError(
            400,
            f"Structured output starts after the reasoning, but {parser.end} is not found "
            f"among this model's tokens, so the reasoning's end cannot be seen "
            f"(--reasoning-parser {parser.name}). Leave the format out, or set "
            "include_reasoning to false to constrain the whole output.",
        )
    return reasoning.grammar_start_token_ids


def _check_num_entries(
    name: str, entries: list[Any] | dict[str, Any] | None, limit: int, flag: str
) -> None:
    if entries is not None and len(entries) > limit:
        raise APIError(
            400,
            f"{name} has {len(entries)} entries; this server allows at most {limit} ({flag}).",
            param=name,
        )


class PromptCharLimit:
    """A prompt text too long for the context window, found before it is tokenized.

    Tokenizing costs time in proportion to the text (seconds for megabytes), so a prompt
    that cannot fit is refused on its length in characters first: no token of this
    tokenizer spells more than `max_token_chars` characters, so a text of n characters is
    at least n / max_token_chars tokens. The bound is loosened 4x, for normalizers that
    fold several characters into one (combining accents, collapsed whitespace)."""

    SLACK = 4

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        max_token_chars = max((len(token) for token in tokenizer.get_vocab()), default=1)
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * max(max_token_chars, 1) * self.SLACK

    def check(self, text: str, param: str) -> None:
        if len(text) > self.max_chars:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, the prompt has {len(text)} characters, far more than that many "
                "tokens can hold. Please reduce the length of the prompt.",
                param=param,
                code="context_length_exceeded",
            )


async def check_structured_output(
    engine: EngineClient, request: SamplingRequest, timeout_s: float | None = None
) -> None:
    """Compile the request's grammar before it starts: an invalid schema, regex or grammar,
    or one that takes longer than `timeout_s` to compile, is a 400 naming the problem and
    never reaches the engine loop."""
    try:
        spec = request.structured_outputs_params()
        if spec is not None:
            await _compile_within(engine, spec, timeout_s)
    except ValueError as e:
        param = next(
            (f for f in STRUCTURED_OUTPUT_FIELDS if getattr(request, f, None) is not None), None
        )
        raise APIError(400, str(e), param=param) from None


async def _compile_within(
    engine: EngineClient, spec: StructuredOutputsParams, timeout_s: float | None
) -> None:
    try:
        await asyncio.wait_for(engine.compile_grammar(spec), timeout_s)
    except TimeoutError:
        # The compile thread runs on (it cannot be interrupted); the request is refused.
        raise ValueError(
            f"Compiling this request's structured output took longer than {timeout_s:g} s "
            "(the server's --grammar-compile-timeout). Simplify the schema, regex or grammar."
        ) from None


STRUCTURED_OUTPUT_FIELDS = (*FORMAT_FIELDS, "tool_choice")
