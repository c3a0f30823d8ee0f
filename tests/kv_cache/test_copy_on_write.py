"""Copy-on-write after fork: only a shared, partly filled block is copied, and the last
holder to write into it writes in place."""

import pytest
from kv_cache.manager_helpers import fork_into, prefilled

from serve.kv_cache.block_manager import BlockManager
from serve.kv_cache.block_pool import NoFreeBlocksError
from serve.sequence import Sequence

BLOCK_SIZE = 4


def grow(manager: BlockManager, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
    """Append `num_tokens` sampled tokens and allocate their slots; returns the copies."""
    for i in range(num_tokens):
        seq.append_token(100 + seq.seq_id * 10 + i, 0.0, None)
    free_before = manager.num_free_blocks
    needed = manager.num_blocks_needed([(seq, seq.num_tokens)])
    copies = manager.allocate_slots(seq, seq.num_tokens)
    assert free_before - manager.num_free_blocks == needed
    seq.num_computed_tokens = seq.num_tokens
    manager.mark_computed(seq)
    manager.check_invariants()
    return copies


def test_fork_then_both_append_copies_the_partial_block_once():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent, child = fork_into(manager, prefilled(manager, 6), 1)
    full, partial = manager.get_block_table(0)
    for seq in (parent, child):
        seq.append_token(7, 0.0, None)
    assert manager.num_blocks_needed([(s, s.num_tokens) for s in (parent, child)]) == 1

    copies = manager.allocate_slots(parent, parent.num_tokens)
    (fresh,) = {dst for _, dst in copies}
    assert copies == [(partial, fresh)]
    assert manager.get_block_table(0) == [full, fresh]
    # The child is now the partial block's only holder: it writes in place.
    assert manager.allocate_slots(child, child.num_tokens) == []
    assert manager.get_block_table(1) == [full, partial]
    assert manager.block_pool.ref_count(full) == 2  # the full block stays shared
    manager.check_invariants()


def test_fork_at_a_block_boundary_copies_nothing():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    family = fork_into(manager, prefilled(manager, 8), 1)
    shared = list(manager.get_block_table(0))
    for seq in family:
        assert grow(manager, seq, 1) == []
    for seq in family:
        assert manager.get_block_table(seq.seq_id)[:2] == shared
    assert all(manager.block_pool.ref_count(b) == 2 for b in shared)
    assert manager.num_free_blocks == 8 - 2 - 2


@pytest.mark.parametrize("num_writers", [1, 2, 3, 4])
def test_fork_into_four_copies_for_all_writers_but_the_last_holder(num_writers):
    manager = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    family = fork_into(manager, prefilled(manager, 5), 3)
    full, partial = manager.get_block_table(0)
    writers = family[:num_writers]
    for seq in writers:
        seq.append_token(9, 0.0, None)
    plan = [(seq, seq.num_tokens) for seq in writers]
    expected = min(num_writers, 3)  # 4 holders: the 4th writer writes in place
    assert manager.num_blocks_needed(plan) == expected
    free_before = manager.num_free_blocks
    copies = [c for seq, n in plan for c in manager.allocate_slots(seq, n)]
    assert free_before - manager.num_free_blocks == expected
    assert len(copies) == expected and all(src == partial for src, _ in copies)
    assert manager.block_pool.ref_count(full) == 4
    assert manager.block_pool.ref_count(partial) == 4 - expected
    manager.check_invariants()


def test_a_chunk_over_a_shared_partial_block_copies_it_and_adds_new_blocks():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent, child = fork_into(manager, prefilled(manager, 6), 1)
    copies = grow(manager, child, 7)  # tokens 6..12: finish block 1 (a copy), blocks 2 and 3
    (_, partial) = manager.get_block_table(0)
    assert [src for src, _ in copies] == [partial]
    assert len(manager.get_block_table(1)) == 4
    assert manager.num_free_blocks == 8 - 2 - 3


def test_copy_on_write_is_all_or_nothing():
    manager = BlockManager(num_blocks=2, block_size=BLOCK_SIZE)
    parent, child = fork_into(manager, prefilled(manager, 6), 1)
    assert manager.num_free_blocks == 0
    child.append_token(3, 0.0, None)
    assert not manager.can_allocate([(child, child.num_tokens)])
    with pytest.raises(NoFreeBlocksError):
        manager.allocate_slots(child, child.num_tokens)
    assert manager.get_block_table(1) == manager.get_block_table(0)
    manager.check_invariants()
    manager.free(0)  # now the child holds the block alone: no copy needed
    assert grow(manager, child, 0) == []


def test_a_dropped_sibling_lets_the_survivor_write_in_place():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    parent, child = fork_into(manager, prefilled(manager, 6), 1)
    manager.free(child.seq_id)
    assert grow(manager, parent, 1) == []
    assert manager.num_free_blocks == 6
