"""EngineCore: the synchronous heart. No asyncio, no HTTP, no text; `step()` runs one
iteration and returns token deltas (output_deltas.py) for a front end to decode."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from serve.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from serve.engine.beam_search import BeamSearch
from serve.engine.cpu_malloc import keep_freed_memory
from serve.engine.logprobs import token_logprobs
from serve.engine.model_runner import ModelInputs, ModelOutput, ModelRunner
from serve.engine.output_deltas import (
    RequestDelta,
    SeqDelta,
    mark_sent,
    step_delta,
    whole_delta,
    whole_seq_delta,
)
from serve.engine.protocol import request_error_message
from serve.engine.sampler import Sampler
from serve.engine.tokenizer import eos_token_ids, load_tokenizer
from serve.kv_cache.block_manager import BlockManager
from serve.models.loader import load_hf_config, model_max_len, resolve_model_path
from serve.outputs import EngineStats, StepTimes
from serve.sampling_params import SamplingParams
from serve.scheduler.output import SchedulerOutput
from serve.scheduler.scheduler import Scheduler
from serve.sequence import FinishReason, Sequence, SequenceGroup

if TYPE_CHECKING:
    from serve.engine.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.05  # an idle engine's longest wait on a compiling grammar


@dataclass
class _Sampled:
    """A step whose tokens are sampled and appended, their deltas not yet built."""

    groups: list[SequenceGroup]  # the requests the step moved
    sample_s: float  # time in the sampler
    failed: list[RequestDelta] = field(default_factory=list)  # requests that failed alone


# A scheduled step: the requests that ended while scheduling it, the step (None: nothing
# to run) and its inputs (None: nothing to run, or only block moves).
_Step = tuple[list[RequestDelta], SchedulerOutput | None, ModelInputs | None]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available here.")
    return torch.device(device)


def fit_max_model_len(requested: int | None, model_limit: int, cache_tokens: int) -> int:
    """The context window the engine can honour: the user's, or the model's fitted to the cache."""
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


def _out_of_vocab(token_ids: Iterable[int], vocab_size: int) -> list[int]:
    return [t for t in token_ids if not 0 <= t < vocab_size]


def check_token_ids(token_ids: list[int], vocab_size: int, what: str = "Token ids") -> None:
    bad = _out_of_vocab(token_ids, vocab_size)
    if bad:
        raise ValueError(f"{what} must be in [0, {vocab_size}); got {bad[:5]}.")


def check_params(params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
    """What SamplingParams cannot check alone: token ids against the vocabulary and logprob
    counts against --max-logprobs. Each message starts with the field's name. The engine
    checks every request; an API process runs the same checks before sending one."""
    for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
        bad = _out_of_vocab(getattr(params, name) or [], vocab_size)
        if bad:
            raise ValueError(f"{name} must name token ids in [0, {vocab_size}); got {bad[:5]}.")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            raise ValueError(
                f"{name} asks for {value} alternatives; this server returns at most "
                f"{max_logprobs} (--max-logprobs)."
            )


class LazyStructuredOutput:
    """The StructuredOutputManager, built on first use: importing xgrammar and indexing the
    vocabulary take seconds that servers without grammars should not pay at start-up.
    Thread-safe: the engine loop and the API's thread may both be first."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._args = (tokenizer, vocab_size, eos_token_ids)
        self._lock = threading.Lock()
        self.built: StructuredOutputManager | None = None  # None until first use

    def get(self) -> StructuredOutputManager:
        with self._lock:
            if self.built is None:
                from serve.engine.structured_output import StructuredOutputManager

                self.built = StructuredOutputManager(*self._args)
        return self.built


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.model_path = resolve_model_path(config.model.model, config.model.load_format)
        hf_config = load_hf_config(self.model_path)
        self.tokenizer = load_tokenizer(config.model.tokenizer or self.model_path)
        self.eos_token_ids = eos_token_ids(self.model_path, hf_config, self.tokenizer)
        self.vocab_size = int(hf_config.vocab_size)
        self.model_runner = ModelRunner(config, self.model_path, hf_config, self.device)

        block_size = config.cache.block_size
        num_blocks = self.model_runner.num_blocks
        self.max_model_len = fit_max_model_len(
            config.model.max_model_len, model_max_len(hf_config), num_blocks * block_size
        )
        self.max_num_batched_tokens = (
            config.scheduler.max_num_batched_tokens
            or DEFAULT_MAX_NUM_BATCHED_TOKENS[self.device.type]
        )
        if not config.scheduler.enable_chunked_prefill:
            # Unchunked, a prompt runs whole in one step: a step must hold the longest one.
            if config.scheduler.max_num_batched_tokens is None:
                self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_model_len)
            elif self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens={self.max_num_batched_tokens} is less than "
                    f"max_model_len={self.max_model_len}: with chunked prefill off a prompt is "
                    "computed whole in one step, so a long one could never run. Raise "
                    f"--max-num-batched-tokens to at least {self.max_model_len}, lower "
                    "--max-model-len, or turn chunked prefill on (--enable-chunked-prefill)."
                )
        self.block_manager = BlockManager(
            num_blocks,
            block_size,
            self.model_runner.num_cpu_blocks,
            config.cache.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            config.scheduler, self.max_num_batched_tokens, self.max_model_len, self.block_manager
        )
        self.sampler = Sampler(config.model.seed, self.eos_token_ids)
        self._grammars = LazyStructuredOutput(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._groups: dict[str, SequenceGroup] = {}
        # Requests whose grammar is still compiling, in arrival order: they join the
        # scheduler when it is ready, so a slow compile never holds up the loop.
        self._awaiting_grammar: dict[str, tuple[SequenceGroup, concurrent.futures.Future]] = {}
        self._beam_searches: dict[str, BeamSearch] = {}
        self._next_seq_id = 0
        self.num_generated_tokens = 0  # sampled tokens, beams included, since start
        self.step_times = StepTimes()
        self.async_scheduling = config.scheduler.async_scheduling
        self._unemitted: _Sampled | None = None  # sampled; deltas built during the next step
        self._ahead: _Step | None = None  # scheduled while the last step ran; runs next
        self._output_thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine-output"
        )
        logger.info(
            "Model %s (%s) on %s in %s; KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB), "
            "swap space %d blocks; prefix caching %s; max_model_len %d",
            self.model_path,
            ",".join(getattr(hf_config, "architectures", None) or ["?"]),
            self.device,
            str(self.model_runner.dtype).removeprefix("torch."),
            num_blocks,
            block_size,
            num_blocks * block_size,
            num_blocks * self.model_runner.bytes_per_block / 2**30,
            self.model_runner.num_cpu_blocks,
            "on" if config.cache.enable_prefix_caching else "off",
            self.max_model_len,
        )

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> None:
        if request_id in self._groups:
            raise ValueError(f"A request with id {request_id!r} is already running.")
        self.check_token_ids(prompt_token_ids, "Prompt token ids")
        self.check_params(params)
        # Everything that can fail comes before the request is registered anywhere, so a
        # failure leaves no trace of it.
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)
        seq = Sequence(self._new_seq_id(), request_id, prompt_token_ids, params, prompt)
        group = SequenceGroup(request_id, [seq], params, prompt, seq.arrival_time)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        self.scheduler.check(group)  # the prompt length and the sequence count
        search = self._beam_search(seq) if params.use_beam_search else None
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured_output.submit(params.structured_outputs)

        self._groups[request_id] = group
        if search is not None:
            self._beam_searches[request_id] = search
        if grammar is not None:
            self._awaiting_grammar[request_id] = (group, grammar)
        else:
            self.scheduler.add(group)

    def _beam_search(self, seq: Sequence) -> BeamSearch:
        params = seq.sampling_params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.eos_token_ids)
        max_output = self.max_model_len - seq.num_prompt_tokens
        if params.max_tokens is not None:
            max_output = min(max_output, params.max_tokens)
        return BeamSearch(params, stop_ids, max_output)

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def check_token_ids(self, token_ids: list[int], what: str = "Token ids") -> None:
        check_token_ids(token_ids, self.vocab_size, what)

    def check_params(self, params: SamplingParams) -> None:
        check_params(params, self.vocab_size, self.config.model.max_logprobs)

    @property
    def structured_output(self) -> StructuredOutputManager:
        return self._grammars.get()

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """End a request and free its blocks; its final message (None: no such request)."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        self._end(group, FinishReason.ABORT)
        return self._delta(group)

    def stop_sequence(self, request_id: str, index: int) -> RequestDelta | None:
        """Finish sequence `index` of a request, whose text the front end found to reach a
        stop string; its siblings run on. Frees its blocks, sampler and grammar state now.
        When it was the request's last running sequence the request ends too: returns its
        final message (siblings that finished since their last message have news)."""
        group = self._groups.get(request_id)
        if group is None:
            return None  # ended meanwhile
        if group.sampling_params.use_beam_search or not 0 <= index < len(group.seqs):
            logger.warning("Request %s has no sequence %d to stop.", request_id, index)
            return None  # beams have no stop strings, and a front end knows only sent seqs
        seq = group.seqs[index]
        if not seq.is_finished:
            seq.finish_reason = FinishReason.STOP
            self.scheduler.finish_seq(seq)
            self._free_seq_state(seq.seq_id)
        mark_sent(seq)  # the front end ended it: its tokens since are dropped there
        if not group.is_finished:
            return None
        self._finish(group)
        return self._delta(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or self._unemitted is not None or self._ahead is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_blocks_total=bm.num_blocks,
            num_blocks_used=bm.block_pool.num_used_blocks,
            num_blocks_cached=bm.block_pool.num_cached_blocks,
            peak_num_blocks_used=bm.block_pool.peak_num_used,
            prefix_cache_queries=bm.prefix_cache.queries,
            prefix_cache_hits=bm.prefix_cache.hits,
            num_preemptions=sched.num_preemptions,
            kv_waste_fraction=bm.kv_waste_fraction(),
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            num_cpu_blocks_used=bm.cpu_pool.num_used_blocks,
        )

    def reset_peak(self) -> None:
        self.block_manager.block_pool.reset_peak()

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """One iteration; returns the new tokens of the requests that made progress.

        With async scheduling (the default), while this step's forward pass runs here, a
        helper thread builds the previous step's token deltas (ending the requests that
        finished) and then schedules the next step and builds its inputs. The next step
        counts the tokens this one will sample before they exist; `run` fills them in.
        So a step's deltas come out with the next step, and a sequence that this step
        ends (a stop token, its length) may be in the next one too, computing a token
        that is dropped. A step that forks sequences (beam search, the first sample of
        `best_of`) is not scheduled past: the next step must know the forks. Without
        async scheduling, each call runs one step start to end. The tokens are the same
        either way.

        The forward stays on the calling thread: on CPU, glibc reuses freed activations
        only in the main thread's heap (a worker thread's arena maps large tensors afresh
        each step, ~20% slower prefill)."""
        if self._ahead is not None:
            (ended, sched, inputs), self._ahead = self._ahead, None
        else:
            ended, sched, inputs = self._schedule(wait_for_grammar=self._unemitted is None)
        previous, self._unemitted = self._unemitted, None
        if sched is None:
            return ended + self._emit(previous)
        if not self.async_scheduling:
            sampled = self._collect(sched, self.model_runner.run(sched, inputs))
            return ended + self._emit(sampled)
        helper = self._output_thread.submit(self._while_running, previous, sched)
        try:
            model_out = self.model_runner.run(sched, inputs)
        finally:
            emitted, self._ahead = helper.result()  # never leave the helper running
        self._unemitted = self._collect(sched, model_out)
        return ended + emitted

    def _while_running(
        self, previous: _Sampled | None, running: SchedulerOutput
    ) -> tuple[list[RequestDelta], _Step | None]:
        """The helper thread's work while `running`'s forward pass runs: the previous
        step's token deltas, then the next step scheduled ahead (None: it is scheduled
        after this step's sampling, as without async scheduling)."""
        start = time.perf_counter()
        deltas = self._emit(previous)
        ahead = None
        if not any(s.is_sampled and self._forks(s.seq) for s in running.scheduled):
            ended, sched, inputs = self._schedule(wait_for_grammar=False)
            if sched is None:
                deltas += ended
            else:
                ahead = ended, sched, inputs
                self.step_times.num_steps_ahead += 1
        self.step_times.overlapped_s += time.perf_counter() - start
        return deltas, ahead

    def _forks(self, seq: Sequence) -> bool:
        """Sampling `seq` may fork it or drop it (beams), so the next step depends on it."""
        group = self._groups.get(seq.request_id)
        return group is not None and (group.sampling_params.use_beam_search or group.needs_fork)

    def _schedule(self, wait_for_grammar: bool) -> _Step:
        """The next step and its input tensors (None: nothing to run), and the requests
        that ended without running (grammar failed, cannot fit). With nothing to run but
        grammars compiling, `wait_for_grammar` waits a little for one instead of
        returning at once (a busy spin)."""
        start = time.perf_counter()
        ended = self._admit_compiled()
        sched = self.scheduler.schedule()
        ended += [self._end_cannot_fit(group) for group in sched.cannot_fit]
        self.step_times.schedule_s += time.perf_counter() - start
        if sched.is_empty and not sched.has_block_moves:
            if wait_for_grammar and self._awaiting_grammar and not ended:
                futures = [future for _, future in self._awaiting_grammar.values()]
                concurrent.futures.wait(
                    futures, timeout=GRAMMAR_POLL_S, return_when=concurrent.futures.FIRST_COMPLETED
                )
            return ended, None, None
        return ended, sched, self.model_runner.prepare(sched)

    def _collect(self, sched: SchedulerOutput, model_out: ModelOutput) -> _Sampled:
        """Sample a step that has run: its tokens are appended and the stops that tokens
        decide (EOS, stop ids, lengths, grammars) applied, so the next step is scheduled
        knowing them. Stop strings are the front end's (it has the text)."""
        start = time.perf_counter()
        self.scheduler.update(sched)
        failed: list[RequestDelta] = []
        self._record_prompt_logprobs(model_out, failed)
        sampled = self._sample(model_out.logits, model_out.sampled_seqs, failed)
        times = self.step_times
        times.num_steps += 1
        times.prepare_s += model_out.prepare_s
        times.forward_s += model_out.forward_s
        times.sample_s += sampled.sample_s
        times.output_s += time.perf_counter() - start - sampled.sample_s
        return sampled

    def _admit_compiled(self) -> list[RequestDelta]:
        """Hand requests whose grammar has compiled to the scheduler; end those whose
        grammar failed (the API compiles first and answers 400, so only direct users of
        the engine get here)."""
        ended: list[RequestDelta] = []
        for request_id, (group, future) in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[request_id]
            with self._request_scope(group, ended):
                self.structured_output.start(group.seqs[0].seq_id, future.result())
                self.scheduler.add(group)
        return ended

    def _record_prompt_logprobs(self, model_out: ModelOutput, failed: list[RequestDelta]) -> None:
        for span in model_out.prompt_spans:
            seq = span.seq
            group = self._groups.get(seq.request_id)
            if group is None:
                continue  # aborted while its step ran
            recorded = group.prompt_logprobs
            if recorded is None or len(recorded) >= span.start + span.count + 1:
                continue  # recomputed after a preemption: already known
            with self._request_scope(group, failed):
                rows = model_out.prompt_logits[span.offset : span.offset + span.count]
                targets = seq.prompt_token_ids[span.start + 1 : span.start + span.count + 1]
                entries = token_logprobs(rows, targets, seq.sampling_params.prompt_logprobs or 0)
                recorded.extend(entries[len(recorded) - 1 - span.start :])

    def _end_cannot_fit(self, group: SequenceGroup) -> RequestDelta:
        logger.warning(
            "Request %s: its %d sequences need more KV blocks than the whole cache holds "
            "(%d); ending them at %d tokens. Raise --kv-cache-memory / "
            "--gpu-memory-utilization, or lower n, best_of or the beam width.",
            group.request_id,
            group.num_live_seqs,
            self.block_manager.num_blocks,
            max(seq.num_tokens for seq in group.live_seqs),
        )
        self._end(group, FinishReason.LENGTH)
        return self._delta(group)

    def _sample(
        self, logits: torch.Tensor, sampled_seqs: list[Sequence], failed: list[RequestDelta]
    ) -> _Sampled:
        rows: list[int] = []  # logits row of each sequence to sample
        seqs: list[Sequence] = []
        beam_rows: dict[str, list[int]] = {}
        for row, seq in enumerate(sampled_seqs):
            if seq.is_finished:
                continue  # aborted or failed while its step ran
            group = self._groups[seq.request_id]
            if group.sampling_params.use_beam_search:
                beam_rows.setdefault(group.request_id, []).append(row)
                continue
            siblings = [seq]
            if group.needs_fork:
                with self._request_scope(group, failed):
                    siblings = self._fork_samples(group)
                if seq.is_finished:
                    continue
            rows += [row] * len(siblings)
            seqs += siblings

        touched: dict[str, SequenceGroup] = {}
        sample_s = 0.0
        self.num_generated_tokens += len(seqs) + sum(len(r) for r in beam_rows.values())
        if seqs:
            sample_start = time.perf_counter()
            sampled = self._run_sampler(logits, rows, seqs, failed)
            sample_s = time.perf_counter() - sample_start
            for seq, token, logprob, top in sampled:
                group = self._groups.get(seq.request_id)
                if group is None:
                    continue  # a sibling failed: the request has ended
                with self._request_scope(group, failed):
                    seq.append_token(token, logprob, top)
                    seq.finish_reason = self._check_stop_token(seq, token)
                    if seq.finish_reason is not None:
                        self.scheduler.finish_seq(seq)
                        self._free_seq_state(seq.seq_id)
                    touched[seq.request_id] = group
        for request_id, group_rows in beam_rows.items():
            group = self._groups[request_id]
            with self._request_scope(group, failed):
                self._beam_step(group, logits[group_rows])
                touched[request_id] = group
        groups = [g for g in touched.values() if g.request_id in self._groups]
        return _Sampled(groups, sample_s, failed)

    def _run_sampler(
        self,
        logits: torch.Tensor,
        rows: list[int],
        seqs: list[Sequence],
        failed: list[RequestDelta],
    ) -> list[tuple[Sequence, int, float, dict[int, float] | None]]:
        """Each sequence's token, logprob and top logprobs. If the batch raises, each
        sequence is sampled alone to find the requests at fault: they fail, the rest of
        the batch runs on."""
        try:
            batch = logits  # one row a sequence already: no copy (a copy of big logits is slow)
            if rows != list(range(len(logits))):  # forks share a row; finished ones have none
                batch = logits.index_select(0, torch.tensor(rows, device=logits.device))
            out = self.sampler(batch, seqs, self._grammar_mask(seqs))
            return list(zip(seqs, out.token_ids, out.logprobs, out.top_logprobs))
        except Exception:
            logger.warning(
                "Sampling a batch of %d sequences failed; sampling them one at a time",
                len(seqs),
                exc_info=True,
            )
        results = []
        for row, seq in zip(rows, seqs):
            group = self._groups.get(seq.request_id)
            if group is None:
                continue  # a sibling failed already
            with self._request_scope(group, failed):
                one = self.sampler(logits[row : row + 1], [seq], self._grammar_mask([seq]))
                results.append((seq, one.token_ids[0], one.logprobs[0], one.top_logprobs[0]))
        return results

    def _emit(self, sampled: _Sampled | None) -> list[RequestDelta]:
        """The token deltas of the requests a sampled step moved; those that finished end
        here (their blocks were freed as their sequences finished)."""
        if sampled is None:
            return []
        start = time.perf_counter()
        deltas = list(sampled.failed)
        for group in sampled.groups:
            if group.request_id not in self._groups:
                continue  # ended meanwhile (aborted, failed); its final message went then
            with self._request_scope(group, deltas):
                if group.is_finished:
                    delta = self._delta(group)
                    self._finish(group)
                    deltas.append(delta)
                elif not group.sampling_params.use_beam_search:
                    deltas.append(self._delta(group))
        self.step_times.output_s += time.perf_counter() - start
        return deltas

    def _grammar_mask(self, seqs: list[Sequence]) -> Any:
        """The sampler's hook that masks what each constrained sequence's grammar forbids;
        None when no sequence in the batch has a grammar."""
        manager = self._grammars.built
        if manager is None or not any(manager.has(seq.seq_id) for seq in seqs):
            return None
        seq_ids = [seq.seq_id for seq in seqs]
        return lambda logits: manager.mask_logits(logits, seq_ids)

    def _free_seq_state(self, seq_id: int) -> None:
        self.sampler.free(seq_id)
        if self._grammars.built is not None:
            self._grammars.built.free(seq_id)

    def _fork_samples(self, group: SequenceGroup) -> list[Sequence]:
        """Fork the prompt sequence, just prefilled, into `best_of` samples that share its
        blocks. Sample i draws from seed + i (when the request has a seed)."""
        (parent,) = group.seqs
        seed = group.sampling_params.seed
        for i in range(1, group.sampling_params.best_of):
            child = parent.fork(self._new_seq_id(), None if seed is None else seed + i)
            self.scheduler.fork(parent, child, group)
            if group.sampling_params.structured_outputs is not None:
                self.structured_output.fork(parent.seq_id, child.seq_id)
        group.forked = True
        return list(group.seqs)

    def _beam_step(self, group: SequenceGroup, logits: torch.Tensor) -> None:
        search = self._beam_searches[group.request_id]
        beams = group.live_seqs
        scores = [seq.beam_score for seq in beams]
        continuations = search.step([seq.output_token_ids for seq in beams], scores, logits)
        # Forks copy their parent before any parent takes its new token.
        taken: set[int] = set()
        next_beams: list[Sequence] = []
        for c in continuations:
            parent = beams[c.parent]
            if c.parent in taken:
                child = parent.fork(self._new_seq_id())
                self.scheduler.fork(parent, child, group)
                next_beams.append(child)
            else:
                taken.add(c.parent)
                next_beams.append(parent)
        for seq, c in zip(next_beams, continuations):
            seq.append_token(c.token_id, c.token_logprob, None)
            seq.beam_score = c.score
        for i, seq in enumerate(beams):
            if i not in taken:
                self.scheduler.finish_seq(seq)  # a dropped beam frees its blocks now
        group.seqs = next_beams
        group.forked = True

    def _check_stop_token(self, seq: Sequence, token: int) -> FinishReason | None:
        """The stops that a sampled token decides alone (stop strings are the front end's)."""
        params = seq.sampling_params
        if params.structured_outputs is not None and self._grammar_ended(seq, token):
            return FinishReason.STOP
        if seq.num_output_tokens >= params.min_tokens:  # vLLM: no stop before min_tokens
            if not params.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return FinishReason.STOP
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _grammar_ended(self, seq: Sequence, token: int) -> bool:
        """Advance the sequence's grammar by `token`: True once the grammar is complete
        (it took a stop token) or if it refused the token, which the mask should prevent."""
        manager = self.structured_output
        if not manager.accept(seq.seq_id, token):
            logger.warning(
                "Request %s: token %d does not fit its structured output; ending it.",
                seq.request_id,
                token,
            )
            return True
        return manager.is_terminated(seq.seq_id)

    @contextlib.contextmanager
    def _request_scope(self, group: SequenceGroup, failed: list[RequestDelta]) -> Iterator[None]:
        """Work on one request: if it raises, that request alone fails (its final message,
        with the error, joins `failed`) and the step goes on. Callers check whether the
        group is still running after the block."""
        try:
            yield
        except Exception as e:
            failed.append(self._fail(group, e))

    def _fail(self, group: SequenceGroup, error: Exception) -> RequestDelta:
        """End a request that raised while the engine processed it, freeing its blocks."""
        if isinstance(error, ValueError):  # e.g. a grammar that cannot be used
            logger.warning("Request %s failed: %s", group.request_id, error)
        else:
            logger.exception("Request %s failed; the engine runs on", group.request_id)
        if group.request_id in self._groups:
            self._beam_searches.pop(group.request_id, None)  # no final message reads it
            self._end(group, FinishReason.ABORT)
        return RequestDelta(group.request_id, [], True, error=request_error_message(error))

    def _end(self, group: SequenceGroup, reason: FinishReason) -> None:
        """End a request before its sequences finished by themselves (aborted, failed,
        cannot fit), wherever it is: running, waiting, or awaiting its grammar."""
        self._awaiting_grammar.pop(group.request_id, None)
        for seq in group.live_seqs:
            seq.finish_reason = reason
        self._finish(group)

    def _finish(self, group: SequenceGroup) -> None:
        self.scheduler.finish(group)
        for seq in group.seqs:
            self._free_seq_state(seq.seq_id)
        del self._groups[group.request_id]

    def _delta(self, group: SequenceGroup) -> RequestDelta:
        """The request's news. Beam search sends one message, at the end: the finished
        hypotheses, best first (or, cut short, the running beams as they are)."""
        params = group.sampling_params
        if not params.use_beam_search:
            return step_delta(group)
        search = self._beam_searches.pop(group.request_id, None) if group.is_finished else None
        if search is None or not search.is_done:
            seqs = [whole_seq_delta(i, seq) for i, seq in enumerate(group.seqs[: params.n])]
            return whole_delta(group, seqs)
        hypotheses = [
            SeqDelta(
                index=i,
                token_ids=h.token_ids,
                logprobs=[],
                top_logprobs=None,
                finish_reason=FinishReason.STOP if h.ended_by_stop_token else FinishReason.LENGTH,
                cumulative_logprob=h.cumulative_logprob,
            )
            for i, h in enumerate(search.finished[: params.n])
        ]
        return whole_delta(group, hypotheses)
