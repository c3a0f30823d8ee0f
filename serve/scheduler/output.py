"""The scheduler's per-step decision, read by the model runner and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from serve.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens whose K/V this step computes, from seq.num_computed_tokens on
    block_table: list[int]  # the block manager's table for `seq`; read-only for everyone else

    @property
    def is_sampled(self) -> bool:
        """True when this step reaches the sequence's last token, so the next one is sampled;
        False for a prefill chunk that stops short of it."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
