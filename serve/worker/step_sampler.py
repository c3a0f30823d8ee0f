"""The driver worker's end of a step: from logits to the step's ModelRunnerOutput.

Each sampled sequence's row is sampled with its own controls (sampler.py), masked by its
grammar (structured_output.py), which then takes the token (a grammar that starts after a
token sequence, the end of a reasoning model's thinking, waits unconsulted until the
output completes it: grammar_start.py); a first sample of `best_of` samples the row once
per fork, each fork with its own seed; beams are scored, not sampled: each beam's best
candidates go back for the scheduler's beam search. Prompt logprobs come from the prompt
rows. Everything goes back as plain data (step.py).

A fault in one request's own work (its sampling parameters, its grammar) fails that
request alone: a batch that raises is re-sampled one row at a time to find it, and the
request is reported in `failed_requests`; its rows get the placeholder token 0, which no
one reads (the scheduler ends the request).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from serve.outputs import request_error_message
from serve.step import BeamCandidates, ModelRunnerOutput, PromptLogprobs
from serve.worker.grammar_start import GrammarStart
from serve.worker.lazy_structured_output import LazyStructuredOutput
from serve.worker.logprobs import token_logprobs
from serve.worker.model_inputs import PromptSpan
from serve.worker.sampler import Sampler
from serve.worker.sequence_mirror import MirroredSequence
from serve.worker.speculative import verify

logger = logging.getLogger(__name__)

PLACEHOLDER_TOKEN = 0  # a failed request's rows: ended by the scheduler, never read

# One sampled row: its sequence, token, logprob, top logprobs and rank (None: not asked).
_Sampled = tuple[MirroredSequence, int, float | None, dict[int, float] | None, int | None]


class StepSampler:
    def __init__(
        self, seed: int, eos_token_ids: Iterable[int], grammars: LazyStructuredOutput
    ) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sampler = Sampler(seed, self.eos_token_ids)
        self.grammars = grammars
        # Sequences whose grammar starts after a token sequence (StructuredOutputsParams.
        # start_after_token_ids) their output has not completed yet: seq id -> (grammar,
        # how far the tokens have gone into the sequence). No matcher masks or takes their
        # tokens until then.
        self._waiting: dict[int, tuple[str, GrammarStart]] = {}

    # -- per-sequence state ------------------------------------------------------------------

    def start(self, seq: MirroredSequence, grammar: str | None, failed: dict[str, str]) -> None:
        """A sequence seen for the first time: its grammar's matcher starts, or waits for
        the tokens it starts after (a match may begin in the prompt's last tokens)."""
        if grammar is None:
            return
        spec = seq.sampling_params.structured_outputs
        if spec is not None and spec.start_after_token_ids:
            start = GrammarStart.after(spec.start_after_token_ids, seq.prompt_token_ids)
            self._waiting[seq.seq_id] = (grammar, start)
            return
        with _request_scope(seq.request_id, failed):
            self.grammars.get().start(seq.seq_id, grammar)

    def fork(self, parent: MirroredSequence, child: MirroredSequence) -> None:
        """`child` samples from here on as `parent` would, with its own random stream."""
        if parent.seq_id in self._waiting:
            self._waiting[child.seq_id] = self._waiting[parent.seq_id]
        manager = self.grammars.built
        if manager is not None and manager.has(parent.seq_id):
            manager.fork(parent.seq_id, child.seq_id)

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.sampler.free(seq_id)
            self._waiting.pop(seq_id, None)
            if self.grammars.built is not None:
                self.grammars.built.free(seq_id)

    # -- one step ------------------------------------------------------------------------------

    def sample(
        self,
        logits: torch.Tensor | None,  # [num_sampled, vocab] float32, row i rows[i]'s (or none)
        rows: list[list[MirroredSequence]],  # per logits row: who samples it (forks share one)
        prompt_logits: torch.Tensor | None,  # [sum of span counts, vocab], the model dtype
        prompt_spans: list[PromptSpan],
        output: ModelRunnerOutput,
        drafts: list[list[int]] | None = None,
    ) -> None:
        """Fill `output` with the step's tokens (row order), beam candidates and prompt
        logprobs; advance the grammars. `drafts[i]`, when given, are the proposals that
        rows[i]'s sequence checks: it has 1 + len(drafts[i]) rows of `logits`."""
        start = time.perf_counter()
        failed = output.failed_requests
        self._prompt_logprobs(prompt_logits, prompt_spans, output)
        if logits is None:  # no sequence samples this step (prefill-only ones alone)
            output.sample_s += time.perf_counter() - start
            return
        if drafts and any(drafts):
            logits, rows = self._verify_proposals(logits, rows, drafts, output)
        sample_rows: list[int] = []
        seqs: list[MirroredSequence] = []
        for row, row_seqs in enumerate(rows):
            if row_seqs[0].sampling_params.use_beam_search:
                self._beam_candidates(logits[row], row_seqs[0], output)
                continue
            sample_rows += [row] * len(row_seqs)
            seqs += row_seqs
        for seq, token, logprob, top, rank in self._sample_rows(logits, sample_rows, seqs, failed):
            output.seq_ids.append(seq.seq_id)
            output.token_ids.append(token)
            output.logprobs.append(logprob)
            output.top_logprobs.append(top)
            output.ranks.append(rank)
            if seq.sampling_params.structured_outputs is not None and seq.request_id not in failed:
                with _request_scope(seq.request_id, failed):
                    if self._grammar_ended(seq, token):
                        output.grammar_ended_seq_ids.append(seq.seq_id)
        output.sample_s += time.perf_counter() - start

    def _verify_proposals(
        self,
        logits: torch.Tensor,
        rows: list[list[MirroredSequence]],
        drafts: list[list[int]],
        output: ModelRunnerOutput,
    ) -> tuple[torch.Tensor, list[list[MirroredSequence]]]:
        """Check the speculating sequences' proposals (speculative.py) and put their tokens
        in `output`; returns the logits rows and the rows of the other sequences."""
        starts = np.cumsum([0] + [1 + len(d) for d in drafts]).tolist()
        plain = [i for i, d in enumerate(drafts) if not d]
        checked = [i for i, d in enumerate(drafts) if d]
        spans = [r for i in checked for r in range(starts[i], starts[i + 1])]
        seqs = [rows[i][0] for i in checked]  # forks and beams never speculate
        index = torch.tensor(spans, dtype=torch.long, device=logits.device)
        spec_logits = logits.index_select(0, index)
        mask = self._proposals_mask([(seq.seq_id, drafts[i]) for i, seq in zip(checked, seqs)])
        try:
            results = verify(self.sampler, spec_logits, seqs, [drafts[i] for i in checked], mask)
        except Exception:
            logger.warning(
                "Checking proposals failed; checking them one sequence at a time", exc_info=True
            )
            results = []
            for i, seq in zip(checked, seqs):
                one = None
                with _request_scope(seq.request_id, output.failed_requests):
                    row_index = torch.arange(starts[i], starts[i + 1], device=logits.device)
                    one_mask = self._proposals_mask([(seq.seq_id, drafts[i])])
                    (one,) = verify(self.sampler, logits[row_index], [seq], [drafts[i]], one_mask)
                results.append(one)
        for i, seq, result in zip(checked, seqs, results):
            output.spec_proposed[seq.seq_id] = len(drafts[i])
            if result is None:  # its request failed
                output.seq_ids.append(seq.seq_id)
                output.token_ids.append(PLACEHOLDER_TOKEN)
                output.logprobs.append(None)
                output.top_logprobs.append(None)
                output.ranks.append(None)
                continue
            output.spec_accepted[seq.seq_id] = result.num_accepted
            sampled = result.sampled
            for j, token in enumerate(sampled.token_ids):
                output.seq_ids.append(seq.seq_id)
                output.token_ids.append(token)
                output.logprobs.append(sampled.logprobs[j])
                output.top_logprobs.append(sampled.top_logprobs[j])
                output.ranks.append(sampled.ranks[j])
                if seq.sampling_params.structured_outputs is not None:
                    ended = False
                    with _request_scope(seq.request_id, output.failed_requests):
                        ended = self._grammar_ended(seq, token)
                    if ended:  # complete (or refused): the sequence stops at this token
                        output.grammar_ended_seq_ids.append(seq.seq_id)
                        break
        first_rows = torch.tensor(
            [starts[i] for i in plain], dtype=torch.long, device=logits.device
        )
        return logits.index_select(0, first_rows), [rows[i] for i in plain]

    def _proposals_mask(
        self, checked: list[tuple[int, list[int]]]
    ) -> Callable[[torch.Tensor], None] | None:
        """The grammar mask of speculating sequences' checked rows (None: no grammar)."""
        manager = self.grammars.built
        if manager is None or not any(manager.has(seq_id) for seq_id, _ in checked):
            return None
        return lambda logits: manager.mask_proposals(logits, checked)

    def _sample_rows(
        self,
        logits: torch.Tensor,
        rows: list[int],
        seqs: list[MirroredSequence],
        failed: dict[str, str],
    ) -> list[_Sampled]:
        """Each sequence's token, logprob, top logprobs and rank, in order. If the batch
        raises, each sequence is sampled alone to find the requests at fault: they fail
        (their rows get the placeholder token), the rest of the batch runs on."""
        if not seqs:
            return []
        try:
            batch = logits  # one row a sequence already: no copy (a copy of big logits is slow)
            if rows != list(range(len(logits))):  # forks share a row; beams have none
                batch = logits.index_select(0, torch.tensor(rows, device=logits.device))
            out = self.sampler(batch, seqs, self._grammar_mask(seqs))
            return list(zip(seqs, out.token_ids, out.logprobs, out.top_logprobs, out.ranks))
        except Exception:
            logger.warning(
                "Sampling a batch of %d sequences failed; sampling them one at a time",
                len(seqs),
                exc_info=True,
            )
        results = []
        for row, seq in zip(rows, seqs):
            sampled = None
            if seq.request_id not in failed:
                with _request_scope(seq.request_id, failed):
                    one = self.sampler(logits[row : row + 1], [seq], self._grammar_mask([seq]))
                    sampled = (
                        seq,
                        one.token_ids[0],
                        one.logprobs[0],
                        one.top_logprobs[0],
                        one.ranks[0],
                    )
            results.append(sampled or (seq, PLACEHOLDER_TOKEN, None, None, None))
        return results

    def _grammar_mask(self, seqs: list[MirroredSequence]) -> Callable[[torch.Tensor], None] | None:
        """The sampler's hook that masks what each constrained sequence's grammar forbids;
        None when no sequence in the batch has a grammar."""
        manager = self.grammars.built
        if manager is None or not any(manager.has(seq.seq_id) for seq in seqs):
            return None
        seq_ids = [seq.seq_id for seq in seqs]
        return lambda logits: manager.mask_logits(logits, seq_ids)

    def _grammar_ended(self, seq: MirroredSequence, token: int) -> bool:
        """Advance the sequence's grammar by `token`: True once the grammar is complete
        (it took a stop token) or if it refused the token, which the mask should prevent.
        A waiting grammar only follows its start sequence, and starts after the token that
        completes it."""
        waiting = self._waiting.get(seq.seq_id)
        if waiting is not None:
            grammar, start = waiting
            advanced = start.advance(token)
            if advanced is not None:
                self._waiting[seq.seq_id] = (grammar, advanced)
            else:
                del self._waiting[seq.seq_id]
                self.grammars.get().start(seq.seq_id, grammar)
            return False
        manager = self.grammars.get()
        if not manager.has(seq.seq_id):
            return False
        if manager.is_terminated(seq.seq_id):
            return True  # ended last step; a step scheduled ahead sampled once more in vain
        if not manager.accept(seq.seq_id, token):
            logger.warning(
                "Request %s: token %d does not fit its structured output; ending it.",
                seq.request_id,
                token,
            )
            return True
        return manager.is_terminated(seq.seq_id)

    def _beam_candidates(
        self, logits: torch.Tensor, seq: MirroredSequence, output: ModelRunnerOutput
    ) -> None:
        """A beam's best next tokens by log-probability, as many as the step may rank."""
        with _request_scope(seq.request_id, output.failed_requests):
            params = seq.sampling_params
            logprobs = torch.log_softmax(logits.float(), dim=-1)  # [vocab]
            k = min(params.num_beam_candidates(self.eos_token_ids), logprobs.numel())
            top = logprobs.topk(k)
            candidates = BeamCandidates(seq.seq_id, top.indices.tolist(), top.values.tolist())
            if params.logprobs is not None:  # every candidate: the chosen token is one
                shown = dict(zip(candidates.token_ids, candidates.logprobs))
                if params.logprobs > k:
                    more = logprobs.topk(min(params.logprobs, logprobs.numel()))
                    shown = dict(zip(more.indices.tolist(), more.values.tolist())) | shown
                candidates.top_logprobs = shown
            output.beam_candidates.append(candidates)

    def _prompt_logprobs(
        self,
        prompt_logits: torch.Tensor | None,
        spans: list[PromptSpan],
        output: ModelRunnerOutput,
    ) -> None:
        for span in spans:
            seq = span.seq
            with _request_scope(seq.request_id, output.failed_requests):
                assert prompt_logits is not None
                rows = prompt_logits[span.offset : span.offset + span.count]
                targets = seq.prompt_token_ids[span.start + 1 : span.start + span.count + 1]
                num_top = seq.sampling_params.prompt_logprobs or 0
                entries, ranks = token_logprobs(rows, targets, num_top)
                output.prompt_logprobs.append(
                    PromptLogprobs(seq.seq_id, span.start, entries, ranks)
                )


@contextlib.contextmanager
def _request_scope(request_id: str, failed: dict[str, str]) -> Iterator[None]:
    """Work on one request's own data: if it raises, that request alone fails."""
    try:
        yield
    except Exception as e:
        logger.exception("Request %s failed in the worker; the batch runs on", request_id)
        failed.setdefault(request_id, request_error_message(e))
