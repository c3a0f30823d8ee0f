"""Iteration-level (Orca-style) continuous batching over a paged KV cache.

One scheduling model for every case: each sequence has `num_computed_tokens`, and every
step decides how many of its remaining tokens to compute — a whole prompt, a prefill
chunk, one decode token, or a recompute after preemption — within the step's budgets.
Running sequences go first (decodes are never starved by new prompts); waiting ones are
admitted FCFS with what is left.
"""

from __future__ import annotations

from collections import deque

from serve.config import SchedulerConfig
from serve.kv_cache.block_manager import BlockManager
from serve.scheduler.output import ScheduledSequence, SchedulerOutput
from serve.sequence import Sequence, SequenceStatus

# Blocks kept free when admitting new work beside running work, so that running
# sequences can grow a little before anything must be preempted (vLLM uses 1%).
WATERMARK_FRACTION = 0.01


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_manager: BlockManager,
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.watermark_blocks = int(WATERMARK_FRACTION * block_manager.num_blocks)
        # Invariant: `running` and `waiting` are each in arrival order, and every running
        # sequence arrived before every waiting one; so running[-1] is the latest arrival.
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        if seq.num_prompt_tokens == 0:
            raise ValueError("The prompt is empty: give at least one token.")
        if seq.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"The prompt has {seq.num_prompt_tokens} tokens, but this model's context "
                f"window (max_model_len) is {self.max_model_len} tokens, and at least one must "
                "be left for the output. Shorten the prompt."
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        token_budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and token_budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, token_budget)
            if not self._allocate_or_preempt(seq, num_new, out):
                break  # `seq` itself was preempted, and everything after it
            out.scheduled.append(self._scheduled(seq, num_new))
            token_budget -= num_new
            i += 1

        # Admitting while preempting would only thrash: the freed blocks go to running work.
        while (
            not out.preempted
            and self.waiting
            and token_budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            num_new = min(seq.num_uncomputed_tokens, token_budget)
            watermark = self.watermark_blocks if self.running else 0
            num_tokens = seq.num_computed_tokens + num_new
            if not self.block_manager.can_allocate(seq.seq_id, num_tokens, watermark):
                break
            self.block_manager.allocate_slots(seq.seq_id, num_tokens)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(self._scheduled(seq, num_new))
            token_budget -= num_new
        return out

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        return ScheduledSequence(seq, num_new, self.block_manager.get_block_table(seq.seq_id))

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Grow `seq`'s blocks for `num_new` tokens, preempting the latest arrivals until
        they fit. Returns False if `seq` itself had to go."""
        num_tokens = seq.num_computed_tokens + num_new
        while not self.block_manager.allocate_slots(seq.seq_id, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop the KV, keep the tokens, go back to the waiting front."""
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens' K/V are now in the cache."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks, in this same step."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
