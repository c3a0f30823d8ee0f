"""Building blocks the block-manager tests share: prefilled and forked sequences, and a
snapshot of the whole allocation state (to show an operation changed nothing)."""

from __future__ import annotations

from serve.kv_cache.block_manager import BlockManager
from serve.sampling_params import SamplingParams
from serve.sequence import Sequence


def prefilled(manager: BlockManager, num_tokens: int, seq_id: int = 0) -> Sequence:
    """A sequence of `num_tokens` distinct tokens (distinct per seq_id), all computed."""
    tokens = [seq_id * 1000 + i for i in range(num_tokens)]
    seq = Sequence(seq_id, f"r{seq_id}", tokens, SamplingParams(max_tokens=8))
    manager.allocate_slots(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    manager.mark_computed(seq)
    return seq


def fork_into(manager: BlockManager, parent: Sequence, num_children: int) -> list[Sequence]:
    children = [parent.fork(parent.seq_id + i) for i in range(1, num_children + 1)]
    for child in children:
        manager.fork(parent, child)
    return [parent, *children]


def allocation_state(manager: BlockManager) -> tuple:
    return (
        {k: list(v) for k, v in manager.block_tables.items()},
        {k: list(v) for k, v in manager.cpu_block_tables.items()},
        [manager.block_pool.ref_count(b) for b in range(manager.num_blocks)],
        [manager.cpu_pool.ref_count(b) for b in range(manager.cpu_pool.num_blocks)],
        manager.block_pool.free_block_ids,
        manager.cpu_pool.free_block_ids,
    )
