"""What the core sends per request and step: the tokens that are new since its last
message, never text.

Text, stop strings and the cumulative `RequestOutput` are the front end's
(output_processor.py), which has the tokenizer. So a step's message costs its new tokens
whatever the outputs' lengths, and the core spends no time decoding. A sequence's finish
is sent when the core decides it from tokens (EOS, stop token ids, lengths, a grammar's
end) or ends it (abort, a cache too small); a stop string is found by the front end,
which then tells the core to stop the sequence (`StopSequence`, or an abort).

The deltas are msgspec structs: a step's list of them crosses from a core process to the
front end as MessagePack (serve/engine/messages.py), ~10x cheaper on each side than
pickling dataclasses, which matters where the host is what bounds a step.

Writers: the functions here alone write `Sequence.num_sent_tokens` and `is_finish_sent`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from serve.outputs import RequestTimes
from serve.sequence import FinishReason, Sequence, SequenceGroup

if TYPE_CHECKING:
    from serve.scheduler.beam_search import BeamSearch


class SeqDelta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One sequence's news: output tokens appended since its last message, and its finish."""

    index: int  # its place among the request's sequences: fork order, or a beam's rank
    token_ids: list[int]
    # Each new token's logprob, which the front end sums; None when the request needs
    # none (SamplingParams.needs_logprobs), and its cumulative_logprob is None.
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None  # per new token, when the request asked
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it
    # A finished beam's score sum (float32, as the search ranks it), which the front end
    # reports instead of summing `logprobs` (a hypothesis keeps none).
    cumulative_logprob: float | None = None
    # Each new token's rank under the model, with `top_logprobs` (None for beams: their
    # entries are all among the best, ranked by their order).
    ranks: list[int] | None = None


class RequestDelta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    request_id: str
    seqs: list[SeqDelta]  # only the sequences with news
    finished: bool  # the core has ended the request and freed its blocks
    # Sent with the request's first message (the prompt is computed by then), with the
    # prompt tokens' ranks (None for the first, as its entry).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    error: str | None = None  # the core failed this request alone (RequestOutput.error)
    times: RequestTimes | None = None  # with the final message of a request that finished
    # A pooling request's final message: its pooled vector (RequestOutput.pooled).
    pooled: list[float] | None = None
    # On every message: prompt tokens the prefix cache held at the request's first
    # scheduling (None before it; RequestOutput.num_cached_tokens), and the times it has
    # been preempted so far. Two small ints: cheaper than knowing which message is first.
    num_cached_tokens: int | None = None
    num_preemptions: int = 0


def step_delta(group: SequenceGroup) -> RequestDelta:
    """The sampled sequences' new tokens and finishes (not for beam search: its beams are
    rewritten every step, and only `whole_delta` is sent, at the end)."""
    # The prompt's logprobs go with the request's first message alone (asked before
    # `_seq_delta` counts this one's tokens as sent).
    is_first = not any(s.num_sent_tokens or s.is_finish_sent for s in group.seqs)
    seqs = []
    for index, seq in enumerate(group.seqs):
        has_news = seq.num_output_tokens > seq.num_sent_tokens
        if has_news or (seq.finish_reason is not None and not seq.is_finish_sent):
            seqs.append(_seq_delta(index, seq, seq.num_sent_tokens))
    return whole_delta(group, seqs, with_prompt_logprobs=is_first)


def beam_search_delta(group: SequenceGroup, search: BeamSearch | None) -> RequestDelta:
    """Beam search's one message, at the end: the finished hypotheses, best first; or,
    cut short (aborted, the cache too small), the running beams as they are."""
    params = group.sampling_params
    if search is None or not search.is_done:
        seqs = [whole_seq_delta(i, seq) for i, seq in enumerate(group.seqs[: params.n])]
        return whole_delta(group, seqs)
    hypotheses = [
        SeqDelta(
            index=i,
            token_ids=h.token_ids,
            logprobs=h.logprobs,
            top_logprobs=h.top_logprobs,
            finish_reason=FinishReason.STOP if h.ended_by_stop_token else FinishReason.LENGTH,
            cumulative_logprob=h.cumulative_logprob,
        )
        for i, h in enumerate(search.finished[: params.n])
    ]
    return whole_delta(group, hypotheses)


def whole_delta(
    group: SequenceGroup, seqs: list[SeqDelta], with_prompt_logprobs: bool = True
) -> RequestDelta:
    """A message of `group` with `seqs`: its only one, with complete sequences (beam
    search's results), or a step's (`step_delta`)."""
    return RequestDelta(
        group.request_id,
        seqs,
        group.is_finished,
        group.prompt_logprobs if with_prompt_logprobs else None,
        group.prompt_ranks if with_prompt_logprobs else None,
        num_cached_tokens=group.num_cached_tokens,
        num_preemptions=group.num_preemptions,
    )


def whole_seq_delta(index: int, seq: Sequence) -> SeqDelta:
    return _seq_delta(index, seq, 0)


def mark_sent(seq: Sequence) -> None:
    """The front end ended this sequence itself (a stop string): nothing more of it needs
    sending."""
    seq.num_sent_tokens = seq.num_output_tokens
    seq.is_finish_sent = True


def _seq_delta(index: int, seq: Sequence, start: int) -> SeqDelta:
    end = seq.num_output_tokens
    params = seq.sampling_params
    top = ranks = None
    if params.logprobs is not None:
        top = seq.output_top_logprobs[start:end]
        if not params.use_beam_search:
            ranks = seq.output_ranks[start:end]
    logprobs = seq.output_logprobs[start:end] if params.needs_logprobs else None
    seq.num_sent_tokens = end
    seq.is_finish_sent = seq.finish_reason is not None
    return SeqDelta(
        index,
        seq.output_token_ids[start:end],
        logprobs,
        top,
        seq.finish_reason,
        seq.stop_reason,
        ranks=ranks,
    )
