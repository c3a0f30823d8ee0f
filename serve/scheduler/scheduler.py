"""Iteration-level (Orca-style) continuous batching over a paged KV cache.

One scheduling model for every case: each sequence has `num_computed_tokens`, and every
step decides how many of its remaining tokens to compute — a whole prompt, a prefill
chunk, one decode token, or a recompute after preemption — within the step's budgets.

The unit is the request (`SequenceGroup`): its sequences are scheduled together, so the
beams of a beam search all get their logits in the same step. Each step fills the token
budget (max_num_batched_tokens) in this order:

1. running decodes: every running group whose live sequences each need exactly one token,
   oldest first — so a long prompt never holds up the token streams of others;
2. running prefills (prompt chunks, recomputes catching up), oldest first, with what the
   decodes left;
3. swapped groups coming back, when their blocks fit, before any new work is admitted;
4. waiting groups admitted FCFS, each taking the longest prefix already in the prefix
   cache, with what is left of the budgets.

Blocks are another matter: running groups take theirs in arrival order, and when blocks
run out the latest arrivals are preempted — swapped to the CPU when they have several
sequences (recomputing all of them would cost more than the copy), recomputed otherwise,
unless `preemption_mode` says. A step that preempts admits nothing and swaps nothing in.

Chunked prefill (`enable_chunked_prefill`, on by default) lets a prompt or a recompute
take whatever budget is left, however little, and finish in later steps. Off, a sequence's
remaining prompt (or catch-up) is scheduled whole or not at all: a running prefill is not
split, and a waiting group that does not fit what is left of the budget waits for a later
step, holding up the groups behind it (FCFS). The engine then requires
max_num_batched_tokens >= max_model_len, so every prompt fits an empty step.

With async scheduling the engine calls `schedule()` for the next step while the current
one runs, before its tokens are sampled. A sequence's tokens in flight count as planned
(`Sequence.num_planned_tokens`: the next step starts after them), and a token still being
sampled counts as one to compute (`num_unscheduled_tokens`), so a decode is scheduled for
a token that does not exist yet; the engine fills it in before the step runs. `update()`
moves a step's tokens from scheduled to computed once it has run. A victim preempted
while in flight is computed in vain (recompute), or swapped out after the step has
written its K/V (the swap-out runs at the start of the next step).
"""

from __future__ import annotations

import bisect
from collections import deque

from serve.config import SchedulerConfig
from serve.kv_cache.block_manager import BlockManager
from serve.scheduler.output import ScheduledSequence, SchedulerOutput
from serve.sequence import Sequence, SequenceGroup, SequenceStatus

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
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.preemption_mode = config.preemption_mode
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.watermark_blocks = int(WATERMARK_FRACTION * block_manager.num_blocks)
        # `running` and `swapped` are kept in arrival order, so running[-1] is the latest
        # arrival (the preemption victim); preempted groups rejoin `waiting` at its front.
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def add(self, group: SequenceGroup) -> None:
        self.check(group)
        for seq in group.seqs:
            seq.status = SequenceStatus.WAITING
        self.waiting.append(group)

    def check(self, group: SequenceGroup) -> None:
        """Refuse (ValueError) a group that could never run."""
        num_prompt = len(group.prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("The prompt is empty: give at least one token.")
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"The prompt has {num_prompt} tokens, but this model's context window "
                f"(max_model_len) is {self.max_model_len} tokens, and at least one must be "
                "left for the output. Shorten the prompt."
            )
        if group.max_num_seqs > min(self.max_num_seqs, self.max_num_batched_tokens):
            raise ValueError(
                f"The request runs {group.max_num_seqs} sequences at once (n, best_of or the "
                f"beam width), more than one step holds (max_num_seqs={self.max_num_seqs}, "
                f"max_num_batched_tokens={self.max_num_batched_tokens}). Ask for fewer, or "
                "raise --max-num-seqs."
            )

    # -- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        plans = self._plan_running()
        # Blocks in arrival order, so that preemption takes the latest arrivals: those after
        # `i`, which have allocated nothing yet this step.
        i = 0
        while i < len(self.running):
            group = self.running[i]
            if group in plans and not self._allocate_or_preempt(group, plans[group], out):
                break  # `group` itself was preempted (and all after it)
            i += 1
        gone = set(out.preempted) | set(out.cannot_fit)
        for group, plan in plans.items():  # decodes first, then prefills
            if group not in gone:
                self._schedule(plan, out)
        budget = self.max_num_batched_tokens - out.num_batched_tokens

        # Admitting while preempting would only thrash: the freed blocks go to running work.
        seats = self.max_num_seqs - sum(g.max_num_seqs for g in self.running)
        while not out.preempted and self.swapped and budget > 0:
            group = self.swapped[0]
            plan = self._plan(group, budget)
            if not plan or group.max_num_seqs > seats:
                break
            needed = self._swap_in_blocks(group, plan)
            if needed > self.block_manager.num_free_blocks - self._watermark():
                if not self.running:  # it holds more than the whole cache: it never will fit
                    self.swapped.pop(0)
                    out.cannot_fit.append(group)
                    continue
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in += self.block_manager.swap_in(group.live_seqs)
            self._set_running(group)
            seats -= group.max_num_seqs
            self._allocate(plan, out)
            budget -= self._schedule(plan, out)

        while not out.preempted and not self.swapped and self.waiting and budget > 0:
            group = self.waiting[0]
            if group.max_num_seqs > seats:
                break
            if not self._admit(group, budget, out):
                if not self.running and not out.scheduled and group.forked:
                    # A recomputed group whose sequences, unshared, outgrow the empty cache.
                    self.waiting.popleft()
                    out.cannot_fit.append(group)
                    continue
                break
            self.waiting.popleft()
            seats -= group.max_num_seqs
            budget = self.max_num_batched_tokens - out.num_batched_tokens
        return out

    def _plan_running(self) -> dict[SequenceGroup, Plan]:
        """The running groups' share of the token budget: every decode that fits (a group
        of several sequences may not, when older decodes took the budget), then prefills
        FCFS, up to the first that does not fit."""
        plans: dict[SequenceGroup, Plan] = {}
        budget = self.max_num_batched_tokens
        for group in self.running:
            if _is_decoding(group) and (plan := self._plan(group, budget)):
                plans[group] = plan
                budget -= len(plan)
        for group in self.running:
            if _is_decoding(group):
                continue
            plan = self._plan(group, budget)
            if not plan:
                break
            plans[group] = plan
            budget -= sum(n for _, n in plan)
        return plans

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
            # that every sequence samples in the same later step (beams need that).
            plan = []
            for seq, r in zip(live, remaining):
                n = self._fit(r - 1, budget)
                if n > 0:
                    plan.append((seq, n))
                    budget -= n
            return plan
        return [(seq, 1) for seq in live] if len(live) <= budget else []

    def _schedule(self, plan: Plan, out: SchedulerOutput) -> int:
        for seq, n in plan:
            start = seq.num_planned_tokens
            is_sampled = start + n == seq.num_tokens + seq.num_pending_tokens
            table = self.block_manager.get_block_table(seq.seq_id)
            out.scheduled.append(ScheduledSequence(seq, start, n, table, is_sampled))
            seq.num_scheduled_tokens += n
            seq.num_pending_tokens += is_sampled
        return sum(n for _, n in plan)

    def _allocate(self, plan: Plan, out: SchedulerOutput) -> None:
        for seq, n in plan:
            copies = self.block_manager.allocate_slots(seq, seq.num_planned_tokens + n)
            out.blocks_to_copy += copies

    def _allocate_or_preempt(self, group: SequenceGroup, plan: Plan, out: SchedulerOutput) -> bool:
        """Grow `group`'s blocks for `plan`, preempting the latest arrivals until they fit.
        Returns False if `group` itself had to go."""
        totals = [(seq, seq.num_planned_tokens + n) for seq, n in plan]
        while not self.block_manager.can_allocate(totals):
            if self.running == [group]:
                # It holds every block in use and still cannot grow: the cache is too small
                # for its sequences together, however long it waits. The engine ends it.
                self.running.pop()
                out.cannot_fit.append(group)
                return False
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is group:
                return False
        self._allocate(plan, out)
        return True

    def _swap_in_blocks(self, group: SequenceGroup, plan: Plan) -> int:
        """Device blocks that swapping `group` back in and running `plan` would take."""
        bm = self.block_manager
        totals = [(seq, seq.num_planned_tokens + n) for seq, n in plan]
        return bm.num_swap_blocks(group.live_seqs, swapped_out=True) + bm.num_blocks_needed(
            totals, swapped_out=True
        )

    def _admit(self, group: SequenceGroup, budget: int, out: SchedulerOutput) -> bool:
        """Start a waiting group: take its cached prefixes, allocate its first chunk."""
        bm = self.block_manager
        live = group.live_seqs
        # Prompt logprobs need the logits of every prompt position, so nothing is skipped.
        use_cache = group.sampling_params.prompt_logprobs is None
        hits = {seq.seq_id: bm.find_cached_prefix(seq) if use_cache else [] for seq in live}
        cached = {seq.seq_id: len(hits[seq.seq_id]) * bm.block_size for seq in live}
        plan = self._plan(group, budget, cached)
        if not plan:
            return False
        new_tokens = {seq.seq_id: n for seq, n in plan}
        needed = bm.num_blocks_to_admit(
            (hits[seq.seq_id], cached[seq.seq_id] + new_tokens.get(seq.seq_id, 0)) for seq in live
        )
        if needed > bm.num_free_blocks - self._watermark():
            return False
        for seq in live:
            seq.num_computed_tokens = bm.take_cached_prefix(seq, hits[seq.seq_id])
        self._set_running(group)
        self._allocate(plan, out)
        self._schedule(plan, out)
        return True

    def _watermark(self) -> int:
        return self.watermark_blocks if self.running else 0

    def _set_running(self, group: SequenceGroup) -> None:
        for seq in group.live_seqs:
            seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, group, key=lambda g: g.arrival_time)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        live = group.live_seqs
        mode = self.preemption_mode or ("swap" if len(live) > 1 else "recompute")
        copies = self.block_manager.swap_out(live) if mode == "swap" else None
        if copies is not None:
            out.blocks_to_swap_out += copies
            for seq in live:
                seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, group, key=lambda g: g.arrival_time)
        else:
            # Recompute (or the swap space is full): drop the KV, keep the tokens. A step
            # still computing the sequence computes it in vain.
            for seq in live:
                self.block_manager.free(seq.seq_id)
                seq.num_computed_tokens = seq.num_scheduled_tokens = 0
                seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(group)
        out.preempted.append(group)
        self.num_preemptions += 1

    # -- after the step --------------------------------------------------------------------------

    def update(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens' K/V are now in the cache (or, for
        a sequence swapped out meanwhile, in the blocks the swap-out will copy)."""
        for s in out.scheduled:
            seq = s.seq
            if seq.status in (SequenceStatus.FINISHED, SequenceStatus.WAITING):
                continue  # ended, or preempted to recompute, while the step ran
            seq.num_computed_tokens += s.num_new_tokens
            seq.num_scheduled_tokens -= s.num_new_tokens
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.mark_computed(seq)

    def fork(self, parent: Sequence, child: Sequence, group: SequenceGroup) -> None:
        """Add `child` (a copy of running `parent`) to `group`, sharing the parent's blocks."""
        self.block_manager.fork(parent, child)
        group.seqs.append(child)

    def finish_seq(self, seq: Sequence) -> None:
        """One sequence of a group is done (or a beam dropped): free its blocks now."""
        self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    def finish(self, group: SequenceGroup) -> None:
        """Remove a finished or aborted request and free all its blocks, in this same step."""
        for queue in (self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        if group in self.waiting:
            self.waiting.remove(group)
        for seq in group.seqs:
            if not seq.is_finished:
                self.finish_seq(seq)


def _is_decoding(group: SequenceGroup) -> bool:
    """Each live sequence needs exactly one token: the one it sampled last step."""
    return all(seq.num_unscheduled_tokens == 1 for seq in group.live_seqs)
