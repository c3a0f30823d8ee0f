"""Iteration-level (Orca-style) continuous batching over a paged KV cache.

The scheduler is the half of the engine that decides; the workers compute. It owns the
requests (`SequenceGroup`s), their queues and their KV block tables (through the block
manager), and runs each step's two ends:

    schedule()                     -> SchedulerOutput (step.py): who computes what, plain data
    update_from_output(out, result) -> token deltas: tokens appended, stops, forks, beams

One scheduling model covers every case: each sequence has `num_computed_tokens`, and
every step decides how many of its remaining tokens to compute — a whole prompt, a
prefill chunk, one decode token, or a recompute after preemption — within the step's
budgets. The unit is the request: its sequences are scheduled together, so the beams of a
beam search all get their logits in the same step. Each step fills the token budget
(max_num_batched_tokens) in this order:

1. running decodes: every running group whose live sequences each need exactly one token,
   in rank order — so a long prompt never holds up the token streams of others;
2. running prefills (prompt chunks, recomputes catching up), in rank order, with what the
   decodes left;
3. swapped groups coming back, when their blocks fit, before waiting work of a worse rank;
4. waiting groups admitted in the policy's order, each taking the longest prefix already
   in the prefix cache, with what is left of the budgets.

The rank is the scheduling policy's (policy.py): arrival under fcfs (the default), the
request's priority then arrival, or sjf's predicted remaining output. Blocks are another
matter: running groups take theirs in rank order, and when blocks run out the worst-ranked
are preempted — swapped to the CPU when they have several sequences (recomputing all of
them would cost more than the copy), recomputed otherwise, unless `preemption_mode` says.
A recomputed group of several sequences comes back in the blocks it held: it is admitted
once its whole catch-up fits, and catches up one sequence at a time, each starting from
the blocks of the prefix it shares with those before it (as its forks had shared them).
A step that preempts for blocks admits nothing and swaps nothing in. Under priority, a
waiting request that lacks seats or blocks first preempts running ones of a worse rank.
A group that cannot grow even holding the whole cache ends with finish reason "length".

Chunked prefill (`enable_chunked_prefill`, on by default) lets a prompt or a recompute
take whatever budget is left, however little, and finish in later steps. Off, a sequence's
remaining prompt (or catch-up) is scheduled whole or not at all: a running prefill is not
split, and a waiting group that does not fit what is left of the budget waits for a later
step, holding up the groups behind it. The engine then requires
max_num_batched_tokens >= max_model_len, so every prompt fits an empty step.

Scheduling ahead (async scheduling) calls `schedule()` for the next step before the
current one's output is in. A sequence's tokens in flight count as planned
(`Sequence.num_planned_tokens`: the next step starts after them), and a token still being
sampled counts as one to compute (`num_unscheduled_tokens`), so a decode is scheduled for
a token that does not exist yet: the workers sampled it and fill it in themselves.
`update_from_output` moves a step's tokens from scheduled to computed. A victim preempted
while in flight is computed in vain (recompute), or swapped out after the step has
written its K/V (the swap-out runs at the start of the next step). A step whose sampling
forks sequences (`SchedulerOutput.forks_sequences`) is not scheduled past.

Prefill-only requests (`max_tokens` 0: an embedding, or a prompt scored for its logprobs)
are scheduled as any prompt is, chunks included, but never sampled: the step that
computes their last prompt token ends them, and `update_from_output` frees their blocks
(full ones stay in the prefix cache) and sends their pooled vector. Pooling that reads
every position (mean, cls) takes no prefix-cache hit: a hit's hidden states are never
computed. Last-token pooling does: the last token is always computed, attending to the
cached K/V as it would to its own.

Writers: everything in a `Sequence` and `SequenceGroup` is written here (serve/sequence.py);
block tables and ref counts by the block manager; what the workers hold by `WorkerSync`.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

from msgspec.structs import replace

from serve.config import SchedulerConfig, SpeculativeMethod
from serve.kv_cache.block_manager import BlockManager
from serve.lora_request import LoRARequest
from serve.multimodal_inputs import MultiModalInput
from serve.outputs import (
    ITERATION_TOKENS_BUCKETS,
    Histogram,
    QueueTimes,
    RequestTimes,
    SpecDecodeStats,
    request_error_message,
)
from serve.sampling_params import SamplingParams
from serve.scheduler.beam_search import BeamSearch
from serve.scheduler.output_deltas import (
    RequestDelta,
    beam_search_delta,
    mark_sent,
    step_delta,
)
from serve.scheduler.policy import make_policy
from serve.scheduler.worker_sync import WorkerSync
from serve.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus
from serve.step import BeamCandidates, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# Blocks kept free when admitting new work beside running work, so that running
# sequences can grow a little before anything must be preempted (vLLM uses 1%).
WATERMARK_FRACTION = 0.01

Plan = list[tuple[Sequence, int]]  # (sequence, tokens to compute this step)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_manager: BlockManager,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
        speculation: SpeculativeMethod | None = None,
        max_loras: int = 0,
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_loras = max_loras  # distinct adapters among the running groups (LoRA)
        self.speculation = speculation
        self.preemption_mode = config.preemption_mode
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.watermark_blocks = int(WATERMARK_FRACTION * block_manager.num_blocks)
        self.worker_sync = WorkerSync(block_manager)
        # Who runs first (policy.py). `running` and `swapped` are kept in its rank order,
        # so running[-1] is the preemption victim; `waiting` is put in its order each step.
        self.policy = make_policy(config, max_model_len)
        self.clock = clock  # the time the policy ages waiting requests by
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.num_preemptions = 0
        self.queue_times = QueueTimes()  # arrival to first scheduled, by priority
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)  # tokens per step run
        self.num_generated_tokens = 0  # tokens appended to sequences, beams included
        self.spec_decode = SpecDecodeStats() if speculation is not None else None
        self._groups: dict[str, SequenceGroup] = {}  # every unfinished request
        # Requests whose grammar is still compiling (the engine's): they join `waiting`
        # once it is ready (`set_grammar`), in arrival order among themselves.
        self.awaiting_grammar: dict[str, SequenceGroup] = {}
        self._seqs: dict[int, Sequence] = {}  # their unfinished sequences
        self._beam_searches: dict[str, BeamSearch] = {}
        self._next_seq_id = 0
        # Final messages of requests ended outside update_from_output (a group that cannot
        # fit the cache, ended while scheduling): the next update returns them.
        self._ended: list[RequestDelta] = []

    # -- requests ----------------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self._groups)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups or self._ended)

    def get_group(self, request_id: str) -> SequenceGroup | None:
        return self._groups.get(request_id)

    def get_seq(self, seq_id: int) -> Sequence | None:
        """An unfinished sequence by id (what a SchedulerOutput names)."""
        return self._seqs.get(seq_id)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        awaits_grammar: bool = False,
        priority: int = 0,
        lora: LoRARequest | None = None,
        mm_inputs: tuple[MultiModalInput, ...] = (),
    ) -> SequenceGroup:
        """Queue a new request (ValueError if it could never run, or its id is taken).
        With `awaits_grammar` it waits for `set_grammar` before it can be scheduled."""
        seq = Sequence(self._next_seq_id, request_id, prompt_token_ids, params, prompt)
        if lora is not None:
            seq.cache_key = lora.cache_key
        seq.mm_inputs = tuple(mm_inputs)
        group = SequenceGroup(
            request_id, [seq], params, prompt, seq.arrival_time, priority=priority, lora=lora
        )
        self.add(group, awaits_grammar)
        return group

    def set_grammar(self, request_id: str, grammar: str) -> None:
        """A request's grammar has compiled: it may now be scheduled."""
        group = self.awaiting_grammar.pop(request_id, None)
        if group is not None:
            group.grammar = grammar
            self.waiting.append(group)

    def fail_request(self, request_id: str, message: str) -> None:
        """End a request that failed outside the step (its grammar did not compile); its
        final message, with `message`, comes with the next update."""
        group = self._groups.get(request_id)
        if group is not None:
            self._ended.append(self._fail(group, message))

    def add(self, group: SequenceGroup, awaits_grammar: bool = False) -> None:
        """Queue a built request: its sequence ids are the caller's (tests build groups)."""
        if group.request_id in self._groups:
            raise ValueError(f"A request with id {group.request_id!r} is already running.")
        self.check(group)
        params = group.sampling_params
        if params.use_beam_search:
            (seq,) = group.seqs
            max_output = self.max_model_len - seq.num_prompt_tokens
            if params.max_tokens is not None:
                max_output = min(max_output, params.max_tokens)
            self._beam_searches[group.request_id] = BeamSearch(
                params, set(self.eos_token_ids), max_output
            )
        if params.prompt_logprobs is not None:
            group.prompt_logprobs, group.prompt_ranks = [None], [None]
        for seq in group.seqs:
            seq.status = SequenceStatus.WAITING
            self._seqs[seq.seq_id] = seq
            self._next_seq_id = max(self._next_seq_id, seq.seq_id + 1)
        self._groups[group.request_id] = group
        self.policy.on_add(group)
        if awaits_grammar:
            self.awaiting_grammar[group.request_id] = group
        else:
            self.waiting.append(group)

    def check(self, group: SequenceGroup) -> None:
        """Refuse (ValueError) a group that could never run."""
        self.check_request(
            len(group.prompt_token_ids),
            group.max_num_seqs,
            group.sampling_params.is_prefill_only,
        )

    def check_request(
        self, num_prompt: int, max_num_seqs: int, is_prefill_only: bool = False
    ) -> None:
        """Refuse (ValueError) a request that could never run: an empty prompt, one that
        leaves no room for output (a prefill-only one needs none), or more sequences at
        once than a step holds."""
        if num_prompt == 0:
            raise ValueError("The prompt is empty: give at least one token.")
        if is_prefill_only and num_prompt > self.max_model_len:
            raise ValueError(
                f"The prompt has {num_prompt} tokens, but this model's context window "
                f"(max_model_len) is {self.max_model_len} tokens. Shorten the prompt."
            )
        if not is_prefill_only and num_prompt >= self.max_model_len:
            raise ValueError(
                f"The prompt has {num_prompt} tokens, but this model's context window "
                f"(max_model_len) is {self.max_model_len} tokens, and at least one must be "
                "left for the output. Shorten the prompt."
            )
        if max_num_seqs > min(self.max_num_seqs, self.max_num_batched_tokens):
            raise ValueError(
                f"The request runs {max_num_seqs} sequences at once (n, best_of or the "
                f"beam width), more than one step holds (max_num_seqs={self.max_num_seqs}, "
                f"max_num_batched_tokens={self.max_num_batched_tokens}). Ask for fewer, or "
                "raise --max-num-seqs."
            )

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """End a request and free its blocks now; its final message (None: no such request)."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        self._end(group, FinishReason.ABORT)
        return self._delta(group)

    def stop_sequence(self, request_id: str, index: int) -> RequestDelta | None:
        """Finish sequence `index` of a request, whose text the front end found to reach a
        stop string; its siblings run on. Frees its blocks now. When it was the request's
        last running sequence the request ends too: returns its final message (siblings
        that finished since their last message have news)."""
        group = self._groups.get(request_id)
        if group is None:
            return None  # ended meanwhile
        if group.sampling_params.use_beam_search or not 0 <= index < len(group.seqs):
            logger.warning("Request %s has no sequence %d to stop.", request_id, index)
            return None  # beams have no stop strings, and a front end knows only sent seqs
        seq = group.seqs[index]
        if not seq.is_finished:
            seq.finish_reason = FinishReason.STOP
            self._finish_seq(seq)
        mark_sent(seq)  # the front end ended it: its tokens since are dropped there
        if not group.is_finished:
            return None
        delta = self._delta(group)
        self._remove(group)
        return delta

    # -- the step: who computes what ----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        preempted: list[SequenceGroup] = []
        cannot_fit: list[SequenceGroup] = []
        now = self.clock()
        self.policy.start_step(now, itertools.chain(self.waiting, self.swapped))
        self.running = self.policy.order(self.running)
        self.swapped = self.policy.order(self.swapped)
        # Yielding to a waiting request of higher rank is not thrashing: unlike `preempted`,
        # it does not hold admissions back (they are what it is for).
        yielded = self._preempt_for_waiting(out) if self.policy.preempts_for_waiting else []
        self.waiting = deque(self.policy.order(self.waiting))
        plans, spec_slots = self._plan_running()
        # Blocks in rank order, so that preemption takes the worst-ranked, mostly those after
        # the group that needs blocks, which have allocated nothing yet this step.
        for group in list(self.running):
            if group in plans and group in self.running:  # not preempted for another
                self._allocate_or_preempt(group, plans[group], out, preempted, cannot_fit)
        gone = set(preempted) | set(cannot_fit)
        for group, plan in plans.items():  # decodes first, then prefills
            if group not in gone:
                self._schedule(group, plan, out, spec_slots)
        budget = self.max_num_batched_tokens - out.num_batched_tokens

        # Admitting while preempting would only thrash: the freed blocks go to running work.
        # A group ended for outgrowing the cache holds its blocks until the step is
        # scheduled, so the cache is not yet free: others start next step (here, nothing
        # running would read as an empty cache, and they would be ended as never fitting).
        # Swapped groups come back before waiting ones of the same rank or worse.
        holds_back = bool(preempted or cannot_fit)
        seats = self._free_seats()
        while not holds_back and self.swapped and budget > 0:
            group = self.swapped[0]
            if self.waiting and self.policy.rank(self.waiting[0]) < self.policy.rank(group):
                break  # a waiting group ranks first: it goes (or waits) first
            plan = self._plan(group, budget)
            if not plan or group.max_num_seqs > seats or not self._adapter_fits(group):
                break
            needed = self._swap_in_blocks(group, plan)
            if needed > self.block_manager.num_free_blocks - self._watermark():
                if not self.running:  # it holds more than the whole cache: it never will fit
                    self.swapped.pop(0)
                    cannot_fit.append(group)
                    continue
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in += self.block_manager.swap_in(group.live_seqs)
            for seq in group.live_seqs:
                self.worker_sync.table_changed(seq.seq_id)
            self._set_running(group)
            seats -= group.max_num_seqs
            self._allocate(plan, out)
            budget -= self._schedule(group, plan, out)

        if not holds_back:
            self._admit_waiting(out, seats, cannot_fit)
        for group in cannot_fit:
            self._ended.append(self._end_cannot_fit(group))
        out.preempted_request_ids = [g.request_id for g in yielded + preempted]
        self.policy.step_scheduled(self.running)
        self.worker_sync.flush(out)
        return out

    def admit_arrivals(self, out: SchedulerOutput) -> None:
        """Start waiting requests in `out`, a step scheduled ahead (while the step before it
        ran) and not run yet, within the token budget and seats it left: a request that
        arrived meanwhile then starts in it instead of a step later. Nothing is preempted
        for them, and nothing is admitted into a step that preempted, or that computes a
        sequence ended since it was scheduled (an abort): that sequence's blocks are free
        again while `out` still writes them."""
        if not self.waiting or out.preempted_request_ids:
            return
        if any(s.seq_id not in self._seqs for s in out.scheduled):
            return
        self.waiting = deque(self.policy.order(self.waiting))
        seats = self._free_seats()
        self._admit_waiting(out, seats, cannot_fit=None)
        self.policy.step_scheduled(self.running)
        # The mirrors' other news since `out` was flushed waits for the next step.

    def _admit_waiting(
        self, out: SchedulerOutput, seats: int, cannot_fit: list[SequenceGroup] | None
    ) -> None:
        """Admit waiting groups in order into `out` while the budget and `seats` last;
        `cannot_fit` collects recomputed groups that will never fit (None: leave them)."""
        budget = self.max_num_batched_tokens - out.num_batched_tokens
        # Groups passed over because their adapter would be one too many in the step: they
        # keep their places, and those behind them with a running adapter (or none) start.
        passed_over: list[SequenceGroup] = []
        while self.waiting and budget > 0:
            group = self.waiting[0]
            if self.swapped and self.policy.rank(self.swapped[0]) <= self.policy.rank(group):
                break  # a swapped group ranks first and could not come back
            if group.max_num_seqs > seats:
                break
            if not self._adapter_fits(group):
                passed_over.append(self.waiting.popleft())
                continue
            if not self._admit(group, budget, out):
                fits_nowhere = not self.running and not out.scheduled and group.forked
                if cannot_fit is not None and fits_nowhere:
                    # A recomputed group that outgrows the empty cache, sharing what it can.
                    self.waiting.popleft()
                    cannot_fit.append(group)
                    continue
                break
            self.waiting.popleft()
            seats -= group.max_num_seqs
            budget = self.max_num_batched_tokens - out.num_batched_tokens
        self.waiting.extendleft(reversed(passed_over))

    def _adapter_fits(self, group: SequenceGroup) -> bool:
        """Whether `group` may run beside the running groups: its adapter is theirs, or
        they use fewer than `max_loras` (the workers' slots for one step)."""
        if group.lora is None:
            return True
        running = {g.lora.lora_int_id for g in self.running if g.lora is not None}
        return group.lora.lora_int_id in running or len(running) < self.max_loras

    def _plan_running(self) -> tuple[dict[SequenceGroup, Plan], dict[int, int]]:
        """The running groups' share of the token budget: every decode that fits (a group
        of several sequences may not, when older decodes took the budget; none past a
        sequence's length, `_ends_by_length`), room for their proposals when speculating,
        then prefills in rank order, up to the first that does not fit. Also returns the
        proposal room by seq id (included in the plans)."""
        plans: dict[SequenceGroup, Plan] = {}
        budget = self.max_num_batched_tokens
        decoding = {group for group in self.running if _is_decoding(group)}
        for group in self.running:
            if group not in decoding or self._ends_by_length(group):
                continue
            if plan := self._plan(group, budget):
                plans[group] = plan
                budget -= len(plan)
        spec_slots = self._plan_speculation(plans, budget)
        budget -= sum(spec_slots.values())
        for group in self.running:
            if group in decoding or _is_fully_scheduled(group):
                continue
            if group.forked:
                self._share_caught_up_prefix(group)
            plan = self._plan(group, budget)
            if not plan:
                break
            plans[group] = plan
            budget -= sum(n for _, n in plan)
        return plans, spec_slots

    def _share_caught_up_prefix(self, group: SequenceGroup) -> None:
        """A recomputed group catches up one sequence at a time (`_plan`). The next one
        to start takes the full blocks of the longest prefix it shares with a sibling
        already caught up (scheduled in an earlier step, so those blocks' K/V are written
        before it reads them), as the forks that made them had shared them. The group
        thus comes back in the blocks it held when it was preempted: one that fitted the
        cache fits again, and its shared prefixes are computed once."""
        bm = self.block_manager
        caught_up: list[tuple[Sequence, int]] = []  # (sibling, tokens it has planned)
        for seq in group.live_seqs:
            if seq.num_unscheduled_tokens <= 1:
                caught_up.append((seq, seq.num_planned_tokens))
                continue
            if not caught_up or seq.num_scheduled_tokens:
                return  # the first to catch up, or under way (a step in flight computes it)
            sibling, num_blocks = _most_shared_blocks(seq, caught_up, bm.block_size)
            if sibling is not None and num_blocks * bm.block_size > seq.num_computed_tokens:
                bm.share_prefix(sibling, seq, num_blocks)
                self.worker_sync.table_changed(seq.seq_id)
                seq.num_computed_tokens = num_blocks * bm.block_size
            return

    def _num_catch_up_blocks(self, group: SequenceGroup) -> int:
        """Blocks a recomputed group's catch-up takes at most: each sequence's tokens but
        its last, less the full blocks it will share with one before it
        (`_share_caught_up_prefix`). Prefix-cache hits can only lower it."""
        bm = self.block_manager
        total = 0
        caught_up: list[tuple[Sequence, int]] = []
        for seq in group.live_seqs:
            target = seq.num_unscheduled_tokens - 1
            _, num_shared = _most_shared_blocks(seq, caught_up, bm.block_size)
            total += bm.num_required_blocks(target) - num_shared
            caught_up.append((seq, target))
        return total

    def _ends_by_length(self, group: SequenceGroup) -> bool:
        """Every live sequence's last token is being sampled by the step in flight:
        `max_tokens` or the model's length ends it then, so a step scheduled ahead would
        compute a token only to drop it."""
        params = group.sampling_params
        for seq in group.live_seqs:
            limit = self.max_model_len
            if params.max_tokens is not None:
                limit = min(limit, seq.num_prompt_tokens + params.max_tokens)
            if not seq.num_pending_tokens or seq.num_tokens + seq.num_pending_tokens < limit:
                return False
        return True

    def _plan_speculation(self, decodes: dict[SequenceGroup, Plan], budget: int) -> dict[int, int]:
        """Room for proposals after each decode, in rank order, from `budget`: as many as
        the method makes, fewer near the sequence's token limits, none for beams, a
        first sample that forks (`best_of`: its last prompt token may be left alone for
        a step, after a chunk) or a seeded sample, and none at all in a step with more
        running sequences than `disable_by_batch_size`.
        Grows the plans; returns the room by seq id."""
        spec = self.speculation
        if spec is None:
            return {}
        num_running = sum(g.num_live_seqs for g in self.running)
        if spec.disable_by_batch_size is not None and num_running > spec.disable_by_batch_size:
            return {}
        slots: dict[int, int] = {}
        for group, plan in decodes.items():
            params = group.sampling_params
            if params.use_beam_search or group.needs_fork:
                continue  # beams are scored, not sampled; a first sample forks
            if params.seed is not None and params.temperature > 0:
                # A seeded sample's tokens must not depend on its neighbours, and the
                # verifier's random draws follow its drafts, whose number does (the budget
                # left, disable_by_batch_size): it decodes plainly.
                continue
            for i, (seq, n) in enumerate(plan):
                # After this step the sequence holds up to its tokens + k + 1 (a bonus token).
                num_tokens = seq.num_tokens + seq.num_pending_tokens
                room = self.max_model_len - num_tokens - 1
                if params.max_tokens is not None:
                    num_output = num_tokens - seq.num_prompt_tokens
                    room = min(room, params.max_tokens - num_output - 1)
                k = min(spec.num_speculative_tokens, room, budget)
                if k > 0:
                    plan[i] = (seq, n + k)
                    slots[seq.seq_id] = k
                    budget -= k
        return slots

    def _fit(self, num_tokens: int, budget: int) -> int:
        """How many of a sequence's `num_tokens` remaining tokens this step computes: as
        many as `budget` allows, or with chunked prefill off all of them or none."""
        if self.enable_chunked_prefill:
            return min(num_tokens, budget)
        return num_tokens if num_tokens <= budget else 0

    def _plan(
        self, group: SequenceGroup, budget: int, cached: dict[int, int] | None = None
    ) -> Plan:
        """How many tokens each live sequence of `group` computes this step, within
        `budget`; `cached` overrides sequences' computed counts (prefix-cache hits)."""
        live = group.live_seqs
        remaining = [
            seq.num_tokens - cached[seq.seq_id] if cached else seq.num_unscheduled_tokens
            for seq in live
        ]
        if len(live) == 1:
            n = self._fit(remaining[0], budget)
            return [(live[0], n)] if n > 0 else []
        if any(r > 1 for r in remaining):
            # Catching up after a recompute: compute all but each sequence's last token, so
            # that every sequence samples in the same later step (beams need that). One
            # sequence at a time, so that the next can start from the blocks it shares
            # with those before it (`_share_caught_up_prefix`), computed in earlier steps.
            for seq, r in zip(live, remaining):
                if r > 1:
                    n = self._fit(r - 1, budget)
                    return [(seq, n)] if n > 0 else []
        return [(seq, 1) for seq in live] if len(live) <= budget else []

    def _schedule(
        self,
        group: SequenceGroup,
        plan: Plan,
        out: SchedulerOutput,
        spec_slots: dict[int, int] | None = None,
    ) -> int:
        for seq, n in plan:
            start = seq.num_planned_tokens
            num_spec = spec_slots.get(seq.seq_id, 0) if spec_slots else 0
            is_sampled = start + n - num_spec == seq.num_tokens + seq.num_pending_tokens
            is_sampled = is_sampled and not group.sampling_params.is_prefill_only
            fork_seq_ids: list[int] = []
            if is_sampled and group.needs_fork:
                fork_seq_ids = [
                    self._new_seq_id() for _ in range(group.sampling_params.best_of - 1)
                ]
            if is_sampled and (group.needs_fork or group.sampling_params.use_beam_search):
                out.forks_sequences = True
            self.worker_sync.schedule(group, seq, start, n, is_sampled, fork_seq_ids, out, num_spec)
            seq.num_scheduled_tokens += n
            seq.num_pending_tokens += is_sampled
        return sum(n for _, n in plan)

    def _allocate(self, plan: Plan, out: SchedulerOutput) -> None:
        for seq, n in plan:
            copies = self.block_manager.allocate_slots(seq, seq.num_planned_tokens + n)
            if copies:  # copy-on-write replaced the block the sequence writes first
                block_size = self.block_manager.block_size
                self.worker_sync.table_changed(seq.seq_id, seq.num_planned_tokens // block_size)
            out.blocks_to_copy += copies

    def _allocate_or_preempt(
        self,
        group: SequenceGroup,
        plan: Plan,
        out: SchedulerOutput,
        preempted: list[SequenceGroup],
        cannot_fit: list[SequenceGroup],
    ) -> None:
        """Grow `group`'s blocks for `plan`, preempting the worst-ranked running groups
        (mostly after it: they have allocated nothing yet this step) until they fit, or
        `group` itself."""
        totals = [(seq, seq.num_planned_tokens + n) for seq, n in plan]
        while not self.block_manager.can_allocate(totals):
            if self.running == [group]:
                # It holds every block in use and still cannot grow: the cache is too small
                # for its sequences together, however long it waits.
                self.running.pop()
                cannot_fit.append(group)
                return
            victim = self.running.pop()  # the worst-ranked: it may be `group` itself
            self._preempt(victim, out)
            preempted.append(victim)
            if victim is group:
                return
        self._allocate(plan, out)

    def _swap_in_blocks(self, group: SequenceGroup, plan: Plan) -> int:
        """Device blocks that swapping `group` back in and running `plan` would take."""
        bm = self.block_manager
        totals = [(seq, seq.num_planned_tokens + n) for seq, n in plan]
        return bm.num_swap_blocks(group.live_seqs, swapped_out=True) + bm.num_blocks_needed(
            totals, swapped_out=True
        )

    def _admission(
        self, group: SequenceGroup, budget: int
    ) -> tuple[dict[int, list[int]], Plan, int] | None:
        """What starting a waiting group takes: its cached prefixes (by seq id), its first
        chunk's plan and the free blocks both use. None if no token of it fits `budget`."""
        bm = self.block_manager
        live = group.live_seqs
        # Prompt logprobs need the logits of every prompt position, and mean or cls pooling
        # the hidden states of every one, so nothing is skipped for them.
        params = group.sampling_params
        use_cache = params.prompt_logprobs is None and not (
            params.pooling is not None and params.pooling.needs_every_position
        )
        hits = {seq.seq_id: bm.find_cached_prefix(seq) if use_cache else [] for seq in live}
        cached = {seq.seq_id: len(hits[seq.seq_id]) * bm.block_size for seq in live}
        plan = self._plan(group, budget, cached)
        if not plan:
            return None
        new_tokens = {seq.seq_id: n for seq, n in plan}
        needed = bm.num_blocks_to_admit(
            (hits[seq.seq_id], cached[seq.seq_id] + new_tokens.get(seq.seq_id, 0)) for seq in live
        )
        if group.forked and len(live) > 1:
            # Recomputed: it starts once its whole catch-up fits, rather than take blocks
            # only to give them back, preempted again, as its later sequences start.
            needed = max(needed, self._num_catch_up_blocks(group))
        return hits, plan, needed

    def _admit(self, group: SequenceGroup, budget: int, out: SchedulerOutput) -> bool:
        """Start a waiting group: take its cached prefixes, allocate its first chunk."""
        bm = self.block_manager
        admission = self._admission(group, budget)
        if admission is None:
            return False
        hits, plan, needed = admission
        if needed > bm.num_free_blocks - self._watermark():
            return False
        for seq in group.live_seqs:
            seq.num_computed_tokens = bm.take_cached_prefix(
                seq, hits[seq.seq_id], was_preempted=group.started
            )
        self.policy.on_admit(group)
        if not group.started:
            group.started = True
            group.num_cached_tokens = group.seqs[0].num_computed_tokens  # its prompt's hits
            group.first_scheduled_time = self.clock()
            self.queue_times.observe(
                group.priority, group.first_scheduled_time - group.arrival_time
            )
        self._set_running(group)
        self._allocate(plan, out)
        self._schedule(group, plan, out)
        return True

    def _preempt_for_waiting(self, out: SchedulerOutput) -> list[SequenceGroup]:
        """The best-ranked waiting group, if it could not start for want of batch seats or
        blocks, takes them from the worst-ranked running groups that yield to it (vLLM's
        priority preemption; sjf's shortest remaining first). Returns the groups preempted."""
        if not self.waiting:
            return []
        head = self.policy.order(self.waiting)[0]
        yielded: list[SequenceGroup] = []
        while (
            self.running
            and self.policy.yields_to(self.running[-1], head)
            and not self._could_start(head)
        ):
            victim = self.running.pop()
            self._preempt(victim, out)
            yielded.append(victim)
        return yielded

    def _could_start(self, group: SequenceGroup) -> bool:
        """Whether `group` would be admitted beside the running groups this step: a seat in
        the batch, and blocks for its first chunk once the running decodes have grown."""
        seats = self._free_seats()
        if group.max_num_seqs > seats or not self._adapter_fits(group):
            return False
        decodes = [g for g in self.running if _is_decoding(g)]
        budget = self.max_num_batched_tokens - sum(g.num_live_seqs for g in decodes)
        admission = self._admission(group, budget)
        if admission is None:
            return True  # the token budget, not blocks or seats, holds it back this step
        growth = self.block_manager.num_blocks_needed(
            [(seq, seq.num_planned_tokens + 1) for g in decodes for seq in g.live_seqs]
        )
        return admission[2] + growth <= self.block_manager.num_free_blocks - self._watermark()

    def _free_seats(self) -> int:
        """Sequences the batch can still take beside the running groups."""
        return self.max_num_seqs - sum(g.max_num_seqs for g in self.running)

    def _watermark(self) -> int:
        return self.watermark_blocks if self.running else 0

    def _set_running(self, group: SequenceGroup) -> None:
        for seq in group.live_seqs:
            seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, group, key=self.policy.rank)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        live = group.live_seqs
        mode = self.preemption_mode or ("swap" if len(live) > 1 else "recompute")
        copies = self.block_manager.swap_out(live) if mode == "swap" else None
        if copies is not None:
            out.blocks_to_swap_out += copies
            for seq in live:
                seq.status = SequenceStatus.SWAPPED
                self.worker_sync.table_changed(seq.seq_id)
            bisect.insort(self.swapped, group, key=self.policy.rank)
        else:
            # Recompute (or the swap space is full): drop the KV, keep the tokens. A step
            # still computing the sequence computes it in vain.
            for seq in live:
                self.block_manager.free(seq.seq_id)
                self.worker_sync.table_changed(seq.seq_id)
                seq.num_computed_tokens = seq.num_scheduled_tokens = 0
                seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(group)
        self.num_preemptions += 1
        group.num_preemptions += 1

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    # -- the step: what it produced -----------------------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[RequestDelta]:
        """Take in a step that has run: its tokens' K/V are now in the cache; its sampled
        tokens are appended and the stops they decide applied (EOS, stop token ids,
        lengths, grammars; stop strings are the front end's, which has the text); first
        samples of `best_of` fork; beam search advances. Returns the token deltas of the
        requests that moved, and the final messages of those that ended."""
        deltas, self._ended = self._ended, []
        if out.scheduled:
            self.iteration_tokens.observe(out.num_batched_tokens)
        self._settle_computed(out, result)
        if self.spec_decode is not None:
            for seq_id, num_proposed in result.spec_proposed.items():
                self.spec_decode.record(num_proposed, result.spec_accepted.get(seq_id, 0))
        for request_id, message in result.failed_requests.items():
            if (group := self._groups.get(request_id)) is not None:
                deltas.append(self._fail(group, message))
        self._record_prompt_logprobs(result, deltas)
        self._finish_prefill_only(out, result, deltas)
        for seq_id, hidden in result.prompt_hidden_states.items():
            seq = self._seqs.get(seq_id)
            if seq is not None and (group := self._groups.get(seq.request_id)) is not None:
                self.policy.on_prompt_hidden_state(group, hidden)
        touched: dict[str, SequenceGroup] = {}
        beam_groups: dict[str, SequenceGroup] = {}
        rows: dict[int, list[int]] = {}  # seq id -> its rows (several when it speculated)
        for row, seq_id in enumerate(result.seq_ids):
            rows.setdefault(seq_id, []).append(row)
        grammar_ended = set(result.grammar_ended_seq_ids)
        for s in out.scheduled:
            if not s.is_sampled:
                continue
            seq = self._seqs.get(s.seq_id)
            group = None if seq is None else self._groups.get(seq.request_id)
            if seq is None or group is None:  # ended while its step ran
                self.worker_sync.discard_forks(s.fork_seq_ids)
                continue
            if group.sampling_params.use_beam_search:
                beam_groups[group.request_id] = group
                continue
            with self._request_scope(group, deltas):
                samples = [seq]
                if s.fork_seq_ids:
                    samples += self._fork_samples(group, seq, s.fork_seq_ids)
                for sample in samples:
                    self._append_sampled(sample, result, rows, sample.seq_id in grammar_ended)
                touched[group.request_id] = group
        candidates = {c.seq_id: c for c in result.beam_candidates}
        for request_id, group in beam_groups.items():
            with self._request_scope(group, deltas):
                self._beam_step(group, [candidates[seq.seq_id] for seq in group.live_seqs])
                touched[request_id] = group
        now = self.clock()
        for group in touched.values():
            if group.request_id not in self._groups:
                continue  # failed meanwhile; its final message is in `deltas`
            if group.first_token_time is None:
                group.first_token_time = now
            with self._request_scope(group, deltas):
                if group.is_finished:
                    delta = replace(self._delta(group), times=_request_times(group, now))
                    self._remove(group)
                    deltas.append(delta)
                elif not group.sampling_params.use_beam_search:
                    deltas.append(self._delta(group))
        return deltas

    def _settle_computed(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """The scheduled tokens' K/V are in the cache now (or, for a sequence swapped out
        meanwhile, in the blocks the swap-out will copy). Of a speculating sequence's
        proposals only the accepted ones count: the rest of the room it had is rolled back,
        and its blocks past what it now holds go back to the pool."""
        for s in out.scheduled:
            seq = self._seqs.get(s.seq_id)
            if seq is None or seq.status in (SequenceStatus.FINISHED, SequenceStatus.WAITING):
                continue  # ended, or preempted to recompute, while the step ran
            num_accepted = result.spec_accepted.get(s.seq_id, 0) if s.num_spec_tokens else 0
            seq.num_computed_tokens += s.num_new_tokens - s.num_spec_tokens + num_accepted
            seq.num_scheduled_tokens -= s.num_new_tokens
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.mark_computed(seq)
                if s.num_spec_tokens:  # as any sequence, it holds blocks for what it computed
                    keep = self.block_manager.trim(seq, seq.num_computed_tokens)
                    self.worker_sync.table_changed(seq.seq_id, keep)

    def _finish_prefill_only(
        self, out: SchedulerOutput, result: ModelRunnerOutput, deltas: list[RequestDelta]
    ) -> None:
        """End the prefill-only requests whose last prompt token this step computed (also
        one preempted while the step ran: what it computed stands), freeing their blocks;
        a pooling one's final message carries its pooled vector. Finish reason: "stop"
        for pooling (vLLM's), "length" for a prompt scored with max_tokens 0 (OpenAI's)."""
        for s in out.scheduled:
            seq = self._seqs.get(s.seq_id)
            group = None if seq is None else self._groups.get(seq.request_id)
            if seq is None or group is None or not group.sampling_params.is_prefill_only:
                continue
            if s.start + s.num_new_tokens < seq.num_prompt_tokens:
                continue  # a chunk short of the end
            with self._request_scope(group, deltas):
                pooled = None
                if group.sampling_params.pooling is not None:
                    pooled = result.pooled[seq.seq_id]  # KeyError: not pooled (fails it)
                    seq.finish_reason = FinishReason.STOP
                else:
                    seq.finish_reason = FinishReason.LENGTH
                self._finish_seq(seq)
                now = self.clock()
                group.first_token_time = now  # the prompt is done: prefill ends here
                delta = replace(self._delta(group), pooled=pooled, times=_request_times(group, now))
                self._remove(group)
                deltas.append(delta)

    def _record_prompt_logprobs(
        self, result: ModelRunnerOutput, failed: list[RequestDelta]
    ) -> None:
        for span in result.prompt_logprobs:
            seq = self._seqs.get(span.seq_id)
            group = None if seq is None else self._groups.get(seq.request_id)
            if group is None or group.prompt_logprobs is None or group.prompt_ranks is None:
                continue  # ended while its step ran
            recorded, ranks = group.prompt_logprobs, group.prompt_ranks
            end = span.start + 1 + len(span.entries)
            if len(recorded) >= end:
                continue  # recomputed after a preemption: already known
            with self._request_scope(group, failed):
                new = len(recorded) - 1 - span.start
                recorded.extend(span.entries[new:])
                ranks.extend(span.ranks[new:])

    def _append_sampled(
        self,
        seq: Sequence,
        result: ModelRunnerOutput,
        rows: dict[int, list[int]],
        grammar_ended: bool,
    ) -> None:
        """Append the sequence's tokens of the step (several, after accepted proposals)
        up to the first that stops it; the rest are dropped."""
        seq_rows = rows[seq.seq_id]  # KeyError: the worker did not sample it (fails it)
        for i, row in enumerate(seq_rows):
            token = result.token_ids[row]
            seq.append_token(
                token, result.logprobs[row], result.top_logprobs[row], result.ranks[row]
            )
            self.num_generated_tokens += 1
            seq.finish_reason = self._stop_reason(
                seq, token, grammar_ended and i == len(seq_rows) - 1
            )
            if seq.finish_reason is not None:
                self._finish_seq(seq)
                return

    def _stop_reason(self, seq: Sequence, token: int, grammar_ended: bool) -> FinishReason | None:
        """The stops that a sampled token decides alone (stop strings are the front end's)."""
        params = seq.sampling_params
        if grammar_ended:  # its grammar took a stop token, or refused the token
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

    def _fork_samples(
        self, group: SequenceGroup, parent: Sequence, fork_seq_ids: list[int]
    ) -> list[Sequence]:
        """Fork the prompt sequence, just prefilled, into `best_of` samples sharing its
        blocks, with the ids the step gave the workers. Sample i draws from seed + i (when
        the request has a seed), as the workers did."""
        seed = group.sampling_params.seed
        children = []
        for i, child_id in enumerate(fork_seq_ids, start=1):
            child = parent.fork(child_id, None if seed is None else seed + i)
            self._fork(parent, child, group, by_workers=True)
            children.append(child)
        group.forked = True
        return children

    def _fork(
        self, parent: Sequence, child: Sequence, group: SequenceGroup, by_workers: bool
    ) -> None:
        """Add `child` (a copy of running `parent`) to `group`, sharing the parent's blocks."""
        self.block_manager.fork(parent, child)
        self.worker_sync.forked(parent.seq_id, child.seq_id, by_workers)
        group.seqs.append(child)
        self._seqs[child.seq_id] = child

    def _beam_step(self, group: SequenceGroup, candidates: list[BeamCandidates]) -> None:
        search = self._beam_searches[group.request_id]
        beams = group.live_seqs
        continuations = search.step(beams, candidates)
        # Forks copy their parent before any parent takes its new token.
        taken: set[int] = set()
        next_beams: list[Sequence] = []
        for c in continuations:
            parent = beams[c.parent]
            if c.parent in taken:
                child = parent.fork(self._new_seq_id())
                self._fork(parent, child, group, by_workers=False)
                next_beams.append(child)
            else:
                taken.add(c.parent)
                next_beams.append(parent)
        self.num_generated_tokens += len(beams)  # each beam's logits gave this step's choice
        for seq, c in zip(next_beams, continuations):
            seq.append_token(c.token_id, c.token_logprob, candidates[c.parent].top_logprobs)
            seq.beam_score = c.score
            self.worker_sync.appended(seq.seq_id, c.token_id)
        for i, seq in enumerate(beams):
            if i not in taken:
                self._finish_seq(seq)  # a dropped beam frees its blocks now
        group.seqs = next_beams
        group.forked = True

    # -- ending requests ----------------------------------------------------------------------

    def _request_scope(self, group: SequenceGroup, failed: list[RequestDelta]) -> _RequestScope:
        """Work on one request: if it raises, that request alone fails (its final message,
        with the error, joins `failed`) and the step goes on. Callers check whether the
        group is still running after the block."""
        return _RequestScope(self, group, failed)

    def _on_request_error(
        self, group: SequenceGroup, failed: list[RequestDelta], e: Exception
    ) -> None:
        if isinstance(e, ValueError):
            logger.warning("Request %s failed: %s", group.request_id, e)
        else:
            logger.exception("Request %s failed; the engine runs on", group.request_id)
        failed.append(self._fail(group, request_error_message(e)))

    def _fail(self, group: SequenceGroup, message: str) -> RequestDelta:
        """End a request whose processing raised (here or in a worker), freeing its blocks."""
        if group.request_id in self._groups:
            self._end(group, FinishReason.ABORT)
        return RequestDelta(group.request_id, [], True, error=message)

    def _end_cannot_fit(self, group: SequenceGroup) -> RequestDelta:
        logger.warning(
            "Request %s: its %d sequences need more KV blocks than the whole cache holds "
            "(%d); ending them after %d output tokens. Raise --kv-cache-memory / "
            "--gpu-memory-utilization, or lower n, best_of or the beam width.",
            group.request_id,
            group.num_live_seqs,
            self.block_manager.num_blocks,
            max(seq.num_output_tokens for seq in group.live_seqs),
        )
        self._end(group, FinishReason.LENGTH)
        return self._delta(group)

    def _end(self, group: SequenceGroup, reason: FinishReason) -> None:
        """End a request before its sequences finished by themselves (aborted, failed,
        cannot fit), wherever it is: running, swapped or waiting."""
        for seq in group.live_seqs:
            seq.finish_reason = reason
        self._remove(group)

    def _remove(self, group: SequenceGroup) -> None:
        """Take a finished or ended request out of every queue, freeing all its blocks."""
        for queue in (self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        if group in self.waiting:
            self.waiting.remove(group)
        self.awaiting_grammar.pop(group.request_id, None)
        for seq in group.seqs:
            if not seq.is_finished:
                self._finish_seq(seq)
        if self._groups.pop(group.request_id, None) is not None:
            self.policy.on_finish(group)
        self._beam_searches.pop(group.request_id, None)

    def _finish_seq(self, seq: Sequence) -> None:
        """One sequence is done (or a beam dropped): free its blocks now."""
        self.block_manager.free(seq.seq_id)
        self.worker_sync.finished(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED

    def _delta(self, group: SequenceGroup) -> RequestDelta:
        """The request's news. Beam search sends one message, at the end: the finished
        hypotheses, best first (or, cut short, the running beams as they are)."""
        if group.sampling_params.use_beam_search:
            return beam_search_delta(group, self._beam_searches.get(group.request_id))
        return step_delta(group)


def _request_times(group: SequenceGroup, now: float) -> RequestTimes | None:
    if group.first_scheduled_time is None or group.first_token_time is None:
        return None
    return RequestTimes(
        queue_s=group.first_scheduled_time - group.arrival_time,
        prefill_s=group.first_token_time - group.first_scheduled_time,
        decode_s=now - group.first_token_time,
    )


class _RequestScope:
    """`Scheduler._request_scope`: a class rather than a contextlib generator, which costs
    ~4x as much, since every running request enters it twice a step."""

    __slots__ = ("scheduler", "group", "failed")

    def __init__(
        self, scheduler: Scheduler, group: SequenceGroup, failed: list[RequestDelta]
    ) -> None:
        self.scheduler, self.group, self.failed = scheduler, group, failed

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> bool:
        if not isinstance(exc, Exception):
            return False  # no error, or one that is not the request's (KeyboardInterrupt)
        self.scheduler._on_request_error(self.group, self.failed, exc)
        return True


def _most_shared_blocks(
    seq: Sequence, siblings: list[tuple[Sequence, int]], block_size: int
) -> tuple[Sequence | None, int]:
    """Of `siblings` (each with the tokens its blocks reach), the one whose blocks hold the
    most full blocks of `seq`'s tokens but its last (which still runs through the model,
    for its logits), and how many: siblings share their prompt, and the output they had
    before a fork parted them."""
    best, most = None, 0
    for sibling, reach in siblings:
        limit = min(seq.num_tokens - 1, sibling.num_tokens, reach) // block_size
        n = min(seq.num_prompt_tokens // block_size, limit)  # blocks of the prompt alone
        while n < limit:  # a block at a time: a slice compares in C
            start, end = n * block_size, (n + 1) * block_size
            if seq.token_ids_between(start, end) != sibling.token_ids_between(start, end):
                break
            n += 1
        if n > most:
            best, most = sibling, n
    return best, most


def _is_fully_scheduled(group: SequenceGroup) -> bool:
    """Every token is computed or being computed, and none is to be sampled: a
    prefill-only request whose last chunk is in flight (async scheduling)."""
    return _all_unscheduled(group, 0)


def _is_decoding(group: SequenceGroup) -> bool:
    """Each live sequence needs exactly one token: the one it sampled last step."""
    return _all_unscheduled(group, 1)


def _all_unscheduled(group: SequenceGroup, num_tokens: int) -> bool:
    """Each live sequence has `num_tokens` tokens no step computes yet (a loop, not
    `all()` over a generator: this runs for every group twice a step)."""
    for seq in group.seqs:
        if not seq.is_finished and seq.num_unscheduled_tokens != num_tokens:
            return False
    return True
