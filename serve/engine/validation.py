"""Request and context checks that both the API process and the engine core run, so that
a bad request is refused before it is sent, with the same message it would get here."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from serve.pooling_params import ModelPooling
from serve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _out_of_vocab(token_ids: Iterable[int], vocab_size: int) -> list[int]:
    return [t for t in token_ids if not 0 <= t < vocab_size]


def check_token_ids(token_ids: list[int], vocab_size: int, what: str = "Token ids") -> None:
    bad = _out_of_vocab(token_ids, vocab_size)
    if bad:
        raise ValueError(f"{what} must be in [0, {vocab_size}); got {bad[:5]}.")


def check_params(
    params: SamplingParams,
    vocab_size: int,
    max_logprobs: int,
    pooling: ModelPooling | None = None,
    eos_token_ids: Iterable[int] = (),
) -> None:
    """What SamplingParams cannot check alone: token ids against the vocabulary, logprob
    counts against --max-logprobs and the vocabulary, pooling against the model (`dimensions`), allowed tokens
    against the model's end-of-sequence ones and the bad words (tokenized first:
    `update_from_tokenizer`). Each message starts with the field's name."""
    for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
        bad = _out_of_vocab(getattr(params, name) or [], vocab_size)
        if bad:
            raise ValueError(f"{name} must name token ids in [0, {vocab_size}); got {bad[:5]}.")
    # Held back until min_tokens are generated: the tokens that would stop the output.
    held_back = {*([] if params.ignore_eos else eos_token_ids), *params.stop_token_ids}
    if params.allowed_token_ids and params.min_tokens and held_back >= {*params.allowed_token_ids}:
        raise ValueError(
            f"allowed_token_ids {params.allowed_token_ids[:5]} are all end-of-sequence or stop "
            f"tokens, which min_tokens={params.min_tokens} holds back: no token could be "
            "generated. Allow another token, or drop min_tokens."
        )
    if params.allowed_token_ids and params.bad_words:
        # A one-token bad word is banned everywhere (a longer one only after its start).
        banned = {ids[0] for ids in params.bad_words_token_ids if len(ids) == 1}
        if banned >= {*params.allowed_token_ids}:
            raise ValueError(
                f"allowed_token_ids {params.allowed_token_ids[:5]} are all bad_words: no token "
                "could be generated. Allow another token, or drop those bad words."
            )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise ValueError(
                f"{name} asks for {value} alternatives; this server returns at most "
                f"{max_logprobs} (--max-logprobs)."
            )
        if value is not None and value > vocab_size:
            raise ValueError(
                f"{name} asks for {value} alternatives; the model's vocabulary has "
                f"{vocab_size} tokens."
            )
    if params.pooling is not None and pooling is not None:
        pooling.check(params.pooling)


def check_priority(priority: int, scheduling_policy: str) -> None:
    """A request's `priority` means something only to the priority policy; elsewhere a
    non-zero one is refused rather than silently ignored (as vLLM does)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}.")
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(
            f"priority is {priority}, but the engine schedules {scheduling_policy}: a "
            "request's priority is used only under the priority policy (`serve "
            '--scheduling-policy priority`, `LLM(scheduling_policy="priority")`). Leave it '
            "out (or 0), or start the engine with that policy."
        )


def fit_max_model_len(
    requested: int | None, model_limit: int, cache_tokens: int, draft_limit: int | None = None
) -> int:
    """The context window the engine can honour: the user's, or the model's fitted to the cache.
    A draft model (speculative decoding) runs at the target's positions, so its context
    (`draft_limit`) bounds the window too, as vLLM's does."""
    if draft_limit is not None and draft_limit < model_limit:
        if requested is not None and requested > draft_limit:
            raise ValueError(
                f"max_model_len={requested} is longer than the draft model supports "
                f"({draft_limit}, its max_position_embeddings; the target supports "
                f"{model_limit}): the draft runs at every position of the context. Lower "
                f"--max-model-len to at most {draft_limit}, or use a draft model with a "
                "longer context."
            )
        if requested is None:
            logger.info(
                "The draft model's context of %d tokens is shorter than the target's %d: "
                "max_model_len is limited to %d by the draft (speculative decoding).",
                draft_limit,
                model_limit,
                draft_limit,
            )
        model_limit = draft_limit
    if requested is not None:
        if requested > model_limit:
            raise ValueError(
                f"max_model_len={requested} is longer than this model supports ({model_limit}, "
                "its max_position_embeddings or sliding window). Lower --max-model-len."
            )
        if requested > cache_tokens:
            raise ValueError(
                f"The KV cache holds {cache_tokens} tokens, fewer than one sequence of "
                f"max_model_len={requested}. Lower --max-model-len to at most {cache_tokens}, "
                "or raise --kv-cache-memory (CPU) / --gpu-memory-utilization (GPU)."
            )
        return requested
    if model_limit > cache_tokens:
        logger.warning(
            "The KV cache holds %d tokens, fewer than the model's context of %d: "
            "max_model_len is set to %d. Raise the KV cache memory for longer contexts.",
            cache_tokens,
            model_limit,
            cache_tokens,
        )
        return cache_tokens
    return model_limit


def check_max_num_batched_tokens(
    budget: int, max_model_len: int, enable_chunked_prefill: bool
) -> None:
    """Unchunked, a prompt runs whole in one step: a step must hold the longest one. The
    budget is `config.fit_max_num_batched_tokens`'s."""
    if not enable_chunked_prefill and budget < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens={budget} is less than max_model_len={max_model_len}: "
            "with chunked prefill off a prompt is computed whole in one step, so a long one "
            f"could never run. Raise --max-num-batched-tokens to at least {max_model_len}, "
            "lower --max-model-len, or turn chunked prefill on (--enable-chunked-prefill)."
        )


def check_gpu_count(tensor_parallel_size: int, num_gpus: int) -> None:
    """One GPU a rank: refuse more ranks than this machine has GPUs (the `mp` executor
    runs every rank here)."""
    if tensor_parallel_size > num_gpus:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} runs one rank per GPU, but this "
            f"machine has {num_gpus} GPU{'s' if num_gpus != 1 else ''}. Lower "
            "--tensor-parallel-size, or use --distributed-executor-backend ray to span "
            "machines."
        )
