"""OutputProcessor: the front end's half of the engine's output, from token deltas to text.

The core sends each request's new tokens (output_deltas.py); here each sequence's text is
decoded incrementally (detokenizer.py), stop strings are applied, and the `RequestOutput`s
are built, of the kind each reader asked for (`OutputKind`): everything so far, what is
new since the last, or the finished output alone. Every front end uses this one class:
`OutputStreams` for the servers (a core process, or the core on a thread) and the offline
`LLM`, so their outputs are the same.

A sequence the core stops with a token (EOS, `stop_token_ids`) keeps the token but not its
text, unless `include_stop_str_in_output`, as in vLLM. A stop string ends a sequence here,
before the core knows: the processor asks the core to stop it (`to_core`: an abort when
the whole request is done, else `StopSequence`) and drops the tokens the core sampled for
it in the meantime. `min_tokens` holds stop strings back as the core holds stop tokens
back; a stop string found in the token that also reached the length limit wins (finish
"stop", as in vLLM). A DELTA output holds back the text that could still begin a stop
string (`stop_holdback`) until more text shows it does not, so no text it hands out is
ever cut.

Thread-safety: `add_request` and `abort_request` may run on another thread than `process`
(a server's event loop, its receiving thread); one thread at a time calls `process`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from serve.engine.detokenizer import IncrementalDetokenizer, find_stop_string, text_decoder
from serve.engine.messages import AbortRequest, StopSequence
from serve.engine.protocol import request_error_message
from serve.engine.request_metrics import FinishedRequest, RequestMetrics
from serve.outputs import CompletionOutput, OutputKind, RequestOutput
from serve.sampling_params import SamplingParams
from serve.scheduler.output_deltas import RequestDelta, SeqDelta
from serve.sequence import FinishReason

logger = logging.getLogger(__name__)


@dataclass
class ProcessedStep:
    outputs: list[RequestOutput] = field(default_factory=list)  # for the requests' readers
    to_core: list[AbortRequest | StopSequence] = field(default_factory=list)


class _SeqOutput:
    """One sequence as the front end knows it."""

    def __init__(
        self, index: int, detokenizer: IncrementalDetokenizer | None, params: SamplingParams
    ) -> None:
        self.index = index
        self.detokenizer = detokenizer  # None: decoded whole (beam search's results)
        self.token_ids: list[int] = []
        # Summed token by token; None for a request that needs no logprobs (vLLM's too).
        self.cumulative_logprob: float | None = 0.0 if params.needs_logprobs else None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # Each token's rank, beside its entry (a beam's entries are ranked by their order).
        self.ranks: list[int] | None = (
            [] if params.logprobs is not None and not params.use_beam_search else None
        )
        # All of it; for a DELTA request, what has not been handed out yet (the held-back
        # tail), so that neither keeping nor sending it costs more as the output grows.
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.num_sent_tokens = 0  # DELTA: output tokens handed out
        self.finish_sent = False  # DELTA: its finish was handed out

    def completion(self) -> CompletionOutput:
        """A snapshot: a reader may hold it while this sequence grows."""
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            self.cumulative_logprob,
            None if self.logprobs is None else list(self.logprobs),
            None if self.finish_reason is None else self.finish_reason.value,
            self.stop_reason,
            None if self.ranks is None else list(self.ranks),
        )

    def delta(self, holdback: int) -> CompletionOutput | None:
        """What is new since the last delta (None: nothing): the new tokens, and the new
        text but its last `holdback` characters while it runs, which a stop string yet to
        come could cut."""
        finished = self.finish_reason is not None
        start = self.num_sent_tokens
        cut = len(self.text) if finished else max(len(self.text) - holdback, 0)
        if not cut and start == len(self.token_ids) and finished == self.finish_sent:
            return None
        text, self.text = self.text[:cut], self.text[cut:]
        self.num_sent_tokens = len(self.token_ids)
        self.finish_sent = finished
        return CompletionOutput(
            self.index,
            text,
            self.token_ids[start:],
            self.cumulative_logprob,
            None if self.logprobs is None else self.logprobs[start:],
            None if self.finish_reason is None else self.finish_reason.value,
            self.stop_reason,
            None if self.ranks is None else self.ranks[start:],
        )


def stop_holdback(stop_strings: Sequence[str]) -> int:
    """Characters of streamed text that could still be the start of a stop string."""
    return max((len(s) for s in stop_strings), default=1) - 1


class RequestState:
    """One request's sequences, text and finish, from its token deltas."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        arrival_time: float,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> None:
        self.request_id = request_id
        self.output_kind = output_kind
        self.holdback = stop_holdback(params.stop_strings)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.tokenizer = tokenizer
        self.seqs: dict[int, _SeqOutput] = {}  # by index, in the order the core made them
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.prompt_ranks: list[int | None] | None = None
        self.pooled: list[float] | None = None
        # The core's, from its latest message (RequestDelta): prompt tokens the prefix
        # cache held (None until scheduled), and the times it was preempted.
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.gave_prompt_logprobs = False  # a DELTA reader gets them once, as vLLM's
        self.is_finished = False
        # time.monotonic() of its arrival here, its first and its latest output tokens.
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def streams(self) -> bool:
        """Whether its output is read as it grows: not when its reader wants the final
        output alone, nor when the returned sequences are chosen at the end (best_of > n,
        beam search)."""
        params = self.params
        return (
            self.output_kind is not OutputKind.FINAL_ONLY
            and not params.use_beam_search
            and params.best_of == params.n
        )

    def apply(self, delta: RequestDelta) -> tuple[bool, list[AbortRequest | StopSequence]]:
        """Take one message: whether the output changed, and what the core must stop."""
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
            self.prompt_ranks = delta.prompt_ranks
        if delta.pooled is not None:
            self.pooled = delta.pooled
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = delta.num_cached_tokens
        self.num_preemptions = delta.num_preemptions
        changed = False
        stopped: list[int] = []  # sequences a stop string ended while the core runs them
        for d in delta.seqs:
            seq = self.seqs.get(d.index)
            if seq is None:
                seq = self.seqs[d.index] = self._new_seq(d.index)
            elif seq.finish_reason is not None:
                continue  # ended here by a stop string: the core's later tokens are dropped
            changed = True
            if self._take(seq, d):
                stopped.append(d.index)
        params = self.params
        num_seqs = params.n if params.use_beam_search else params.best_of
        self.is_finished = delta.finished or (
            len(self.seqs) == num_seqs and _all_finished(self.seqs.values())
        )
        if self.is_finished:
            to_core = [] if delta.finished else [AbortRequest(self.request_id)]
            return True, to_core
        return changed, [StopSequence(self.request_id, index) for index in stopped]

    def next_output(self) -> RequestOutput | None:
        """The output its reader gets now, of its kind (None: a delta with nothing new).
        One that does not stream gets its whole output once, finished."""
        if self.output_kind is not OutputKind.DELTA or not self.streams:
            return self.output()
        completions = []
        for seq in self.seqs.values():
            completion = seq.delta(self.holdback)
            if completion is not None:
                completions.append(completion)
        if not completions and not self.is_finished:
            return None
        out = self._request_output(completions)
        if self.gave_prompt_logprobs:  # each delta holds what is new: they were given
            out.prompt_logprobs = out.prompt_ranks = None
        elif out.prompt_logprobs is not None:
            self.gave_prompt_logprobs = True
        return out

    def output(self) -> RequestOutput:
        """Everything so far (for a DELTA request: only before anything was handed out)."""
        completions = [seq.completion() for seq in self.seqs.values()]
        if self.is_finished and self.params.best_of > self.params.n:
            if not self.params.use_beam_search:  # beams come ranked by the search
                # best_of > n needs logprobs: every sample's sum is a float.
                completions.sort(key=lambda c: c.cumulative_logprob, reverse=True)
            completions = completions[: self.params.n]
            for i, c in enumerate(completions):
                c.index = i
        return self._request_output(completions)

    def _request_output(self, completions: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            self.is_finished,
            self.prompt_logprobs,
            self.prompt_ranks,
            pooled=self.pooled,
            num_cached_tokens=self.num_cached_tokens,
        )

    def _new_seq(self, index: int) -> _SeqOutput:
        params = self.params
        detokenizer = None
        if not params.use_beam_search:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, self.prompt_token_ids, params.skip_special_tokens
            )
        return _SeqOutput(index, detokenizer, params)

    def _take(self, seq: _SeqOutput, d: SeqDelta) -> bool:
        """Append the delta's tokens one at a time, decoding each; True when a stop string
        ends the sequence before the core has (the tokens after it are dropped). The text
        of a stop token that ended it (EOS, a `stop_token_ids` entry) is left out."""
        drops_stop_text = (
            d.finish_reason is FinishReason.STOP and not self.params.include_stop_str_in_output
        )
        for i, token_id in enumerate(d.token_ids):
            seq.token_ids.append(token_id)
            if seq.cumulative_logprob is not None and d.logprobs and i < len(d.logprobs):
                seq.cumulative_logprob += d.logprobs[i]
            if seq.logprobs is not None and d.top_logprobs is not None:
                seq.logprobs.append(d.top_logprobs[i])
            if seq.ranks is not None and d.ranks is not None:
                seq.ranks.append(d.ranks[i])
            core_finish = d.finish_reason if i == len(d.token_ids) - 1 else None
            if core_finish is not None and drops_stop_text:
                break
            if seq.detokenizer is not None:
                new_text = seq.detokenizer.update(seq.token_ids)
                seq.text += new_text
                if self._stop_string(seq, core_finish, len(new_text)):
                    return core_finish is None
        if seq.detokenizer is None:  # a beam, decoded whole
            ids = seq.token_ids[:-1] if drops_stop_text else seq.token_ids
            seq.text = text_decoder(self.tokenizer)(ids, self.params.skip_special_tokens)
        if d.cumulative_logprob is not None:
            seq.cumulative_logprob = d.cumulative_logprob
        seq.finish_reason, seq.stop_reason = d.finish_reason, d.stop_reason
        return False

    def _stop_string(self, seq: _SeqOutput, core_finish: FinishReason | None, num_new: int) -> bool:
        """Whether the newest text completes a stop string; the text is cut there. Also
        checked when this token reached the length limit: the stop string wins."""
        if core_finish not in (None, FinishReason.LENGTH):
            return False
        params = self.params
        # As vLLM: a stop string counts once it ends in text past the first min_tokens
        # tokens (the token that makes min_tokens can complete none).
        if len(seq.token_ids) <= params.min_tokens:
            return False
        found = find_stop_string(
            seq.text, num_new, params.stop_strings, params.include_stop_str_in_output
        )
        if found is None:
            return False
        keep, stop = found
        seq.text = seq.text[:keep]
        seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
        return True


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestState] = {}
        self._lock = threading.Lock()  # guards _requests between threads
        self.metrics = RequestMetrics()  # written by `process` (and aborts), read anywhere

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> None:
        """Track a request, whose outputs are of `output_kind`. FINAL_ONLY: `process` gives
        its output once, finished, not a snapshot every step: for a reader that keeps only
        the last (a response that is not streamed), those snapshots cost the front end its
        time for nothing."""
        state = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            self.tokenizer,
            time.monotonic(),
            output_kind,
        )
        with self._lock:
            self._requests[request_id] = state

    def abort_request(self, request_id: str) -> None:
        """Forget a request (its reader left, or it was aborted): its later deltas are
        dropped."""
        with self._lock:
            state = self._requests.pop(request_id, None)
        if state is not None and not state.is_finished:
            self.metrics.ended_early("abort")

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def process(self, deltas: list[RequestDelta]) -> ProcessedStep:
        """One core message: the outputs to hand to the requests' readers (every change of
        a streamed request, the final output of the others; a failed request's carries
        the error) and the stops to send to the core. A fault while processing a request
        fails that request alone (and aborts it in the core)."""
        with self._lock:
            states = [self._requests.get(d.request_id) for d in deltas]
        step = ProcessedStep()
        ended: list[str] = []
        now = time.monotonic()
        for delta, state in zip(deltas, states):
            if state is None:
                continue  # ended here already (a stop string, a fault) or forgotten
            if delta.error is not None:
                ended.append(state.request_id)
                step.outputs.append(_failed(state, delta.error))
                self.metrics.ended_early("error")
                continue
            try:
                changed, to_core = state.apply(delta)
                output = (
                    state.next_output()
                    if state.is_finished or (changed and state.streams)
                    else None
                )
            except Exception as e:
                logger.exception("Request %s: processing its output failed", state.request_id)
                ended.append(state.request_id)
                step.outputs.append(_failed(state, request_error_message(e)))
                self.metrics.ended_early("error")
                if not delta.finished:
                    step.to_core.append(AbortRequest(state.request_id))
                continue
            step.to_core += to_core
            self._observe(state, delta, now)
            if state.is_finished:
                ended.append(state.request_id)
            if output is not None:
                step.outputs.append(output)
        if ended:
            with self._lock:
                for request_id in ended:
                    self._requests.pop(request_id, None)
        return step

    def _observe(self, state: RequestState, delta: RequestDelta, now: float) -> None:
        """Time the request's new tokens, and its end."""
        num_new = 0
        for d in delta.seqs:
            num_new += len(d.token_ids)
        if num_new:
            if state.first_token_time is None:
                state.first_token_time = now
                self.metrics.first_token(
                    now - state.arrival_time,
                    len(state.prompt_token_ids),
                    state.num_cached_tokens or 0,
                )
                self.metrics.new_tokens(num_new, None)
            else:
                self.metrics.new_tokens(num_new, now - (state.last_token_time or now))
            state.last_token_time = now
        if not state.is_finished:
            return
        first = next(iter(state.seqs.values()), None)
        if first is None or first.finish_reason in (None, FinishReason.ABORT):
            self.metrics.ended_early("abort")  # ended by the core (a shutdown, a stop)
            return
        params = state.params
        if params.is_prefill_only:  # no first token: its prompt counts now
            self.metrics.prompt_done(len(state.prompt_token_ids), state.num_cached_tokens or 0)
        decode_s = None  # its tokens came all at once (beam search's results), or none did
        if state.first_token_time is not None and state.last_token_time is not None:
            if state.last_token_time > state.first_token_time:
                decode_s = state.last_token_time - state.first_token_time
        seq_lens = [len(s.token_ids) for s in state.seqs.values()]
        self.metrics.finished(
            FinishedRequest(
                reason=first.finish_reason.value,
                e2e_s=now - state.arrival_time,
                decode_s=decode_s,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_generated_tokens=sum(seq_lens),
                max_seq_tokens=max(seq_lens),
                max_tokens=params.max_tokens,
                n=params.n,
                times=delta.times,
                num_preemptions=state.num_preemptions,
                is_prefill_only=params.is_prefill_only,
            )
        )


def _failed(state: RequestState, error: str) -> RequestOutput:
    return RequestOutput(
        state.request_id, state.prompt, state.prompt_token_ids, finished=True, error=error
    )


def _all_finished(seqs: Iterable[_SeqOutput]) -> bool:
    """Every sequence has its finish reason (a loop: `all()` over a generator costs more,
    for each request every step)."""
    for seq in seqs:
        if seq.finish_reason is None:
            return False
    return True
