"""The scheduler's per-step decision, read by the model runner and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from serve.kv_cache.block_manager import BlockCopy
from serve.sequence import Sequence, SequenceGroup


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    start: int  # the first position this step computes (the sequence's planned tokens then)
    num_new_tokens: int  # tokens whose K/V this step computes, from `start` on
    block_table: list[int]  # the block manager's table for `seq`; read-only for everyone else
    # True when this step reaches the sequence's last token, so the next one is sampled;
    # False for a prefill chunk that stops short of it.
    is_sampled: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    # Groups that cannot grow even holding the whole cache (several long sequences); the
    # engine finishes them with finish_reason "length".
    cannot_fit: list[SequenceGroup] = field(default_factory=list)
    # Block moves the cache engine makes before the forward pass, in this order: swap-outs
    # read blocks that swap-ins and copies may then overwrite.
    blocks_to_swap_out: list[BlockCopy] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[BlockCopy] = field(default_factory=list)  # (cpu, device)
    blocks_to_copy: list[BlockCopy] = field(default_factory=list)  # (src, dst) copy-on-write

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def has_block_moves(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)
