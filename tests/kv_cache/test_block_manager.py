"""BlockManager basics: growth, all-or-nothing allocation, fork, free, accounting.

Prefix caching, copy-on-write and swapping have their own files; the random-operation
property test is test_block_manager_machine.py.
"""

import pytest

from serve.kv_cache.block_manager import BlockManager
from serve.kv_cache.block_pool import NoFreeBlocksError
from serve.sampling_params import SamplingParams
from serve.sequence import Sequence


def make_manager(num_blocks: int = 8, block_size: int = 4, **kwargs) -> BlockManager:
    manager = BlockManager(num_blocks=num_blocks, block_size=block_size, **kwargs)
    manager.check_invariants()
    return manager


def make_seq(seq_id: int, num_tokens: int = 40) -> Sequence:
    """A sequence whose tokens no other sequence shares (no accidental prefix hits)."""
    tokens = [seq_id * 1000 + i for i in range(num_tokens)]
    return Sequence(seq_id, f"r{seq_id}", tokens, SamplingParams(max_tokens=4))


def compute(manager: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """Allocate and 'run' `num_tokens` more of `seq`'s tokens, as a scheduler step does."""
    manager.allocate_slots(seq, seq.num_computed_tokens + num_tokens)
    seq.num_computed_tokens += num_tokens
    manager.mark_computed(seq)


def test_rejects_empty_device_pool_and_bad_block_size():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=4, block_size=0)


@pytest.mark.parametrize(("num_tokens", "expected"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2)])
def test_num_required_blocks(num_tokens, expected):
    assert make_manager(block_size=4).num_required_blocks(num_tokens) == expected


def test_allocate_slots_grows_ceil_blocks():
    manager = make_manager(num_blocks=8, block_size=4)
    seq = make_seq(0)
    assert manager.num_blocks_needed([(seq, 5)]) == 2
    assert manager.allocate_slots(seq, 5) == []
    manager.check_invariants()
    assert len(manager.get_block_table(0)) == 2
    assert manager.num_blocks_needed([(seq, 8)]) == 0
    assert manager.allocate_slots(seq, 8) == []  # fills the last block, no new one
    assert len(manager.get_block_table(0)) == 2
    assert manager.allocate_slots(seq, 9) == []
    manager.check_invariants()
    assert len(manager.get_block_table(0)) == 3
    assert manager.num_free_blocks == 5
    assert manager.usage == pytest.approx(3 / 8)


def test_allocate_slots_is_all_or_nothing():
    manager = make_manager(num_blocks=4, block_size=4)
    seq0, seq1 = make_seq(0), make_seq(1)
    manager.allocate_slots(seq0, 8)
    assert not manager.can_allocate([(seq1, 12)])
    with pytest.raises(NoFreeBlocksError):
        manager.allocate_slots(seq1, 12)  # needs 3 blocks, 2 free
    manager.check_invariants()
    assert not manager.has_table(1)
    with pytest.raises(NoFreeBlocksError):
        manager.allocate_slots(seq0, 20)  # needs 3 more, 2 free
    manager.check_invariants()
    assert len(manager.get_block_table(0)) == 2
    assert manager.num_free_blocks == 2


def test_num_blocks_needed_sums_a_plan():
    manager = make_manager(num_blocks=8, block_size=4)
    seq0, seq1 = make_seq(0), make_seq(1)
    manager.allocate_slots(seq0, 3)
    assert manager.num_blocks_needed([(seq0, 9), (seq1, 4)]) == 2 + 1
    assert manager.can_allocate([(seq0, 9), (seq1, 4)], watermark_blocks=4)
    assert not manager.can_allocate([(seq0, 9), (seq1, 4)], watermark_blocks=5)


def test_can_allocate_respects_watermark():
    manager = make_manager(num_blocks=4, block_size=4)
    seq = make_seq(0)
    assert manager.can_allocate([(seq, 16)])
    assert not manager.can_allocate([(seq, 16)], watermark_blocks=1)
    assert manager.can_allocate([(seq, 12)], watermark_blocks=1)


def test_free_returns_all_blocks():
    manager = make_manager(num_blocks=8, block_size=4)
    manager.allocate_slots(make_seq(0), 10)
    manager.allocate_slots(make_seq(1), 3)
    manager.check_invariants()
    manager.free(0)
    manager.check_invariants()
    assert not manager.has_table(0)
    assert manager.num_free_blocks == 7
    manager.free(1)
    manager.free(1)  # unknown seq: no-op
    manager.check_invariants()
    assert manager.num_free_blocks == 8
    assert manager.usage == 0.0


def test_fork_shares_blocks_until_both_freed():
    manager = make_manager(num_blocks=8, block_size=4)
    parent = make_seq(0)
    compute(manager, parent, 6)
    child = parent.fork(1)
    manager.fork(parent, child)
    manager.check_invariants()
    parent_table = manager.get_block_table(0)
    assert manager.get_block_table(1) == parent_table
    assert manager.get_block_table(1) is not parent_table
    assert all(manager.block_pool.ref_count(b) == 2 for b in parent_table)
    assert manager.num_free_blocks == 6
    manager.free(0)
    manager.check_invariants()
    assert all(manager.block_pool.ref_count(b) == 1 for b in parent_table)
    assert manager.num_free_blocks == 6
    manager.free(1)
    manager.check_invariants()
    assert manager.num_free_blocks == 8


def test_fork_onto_existing_table_raises():
    manager = make_manager()
    seq0, seq1 = make_seq(0), make_seq(1)
    manager.allocate_slots(seq0, 4)
    manager.allocate_slots(seq1, 4)
    with pytest.raises(ValueError):
        manager.fork(seq0, seq1)
    manager.check_invariants()


def test_take_cached_prefix_onto_existing_table_raises():
    manager = make_manager()
    seq = make_seq(0)
    manager.allocate_slots(seq, 4)
    with pytest.raises(ValueError):
        manager.take_cached_prefix(seq, [])
    manager.check_invariants()


def test_kv_waste_fraction_counts_unfilled_slots_of_distinct_blocks():
    manager = make_manager(num_blocks=8, block_size=4)
    assert manager.kv_waste_fraction() == 0.0
    parent = make_seq(0)
    compute(manager, parent, 6)  # 2 blocks, 6 of 8 slots filled
    assert manager.kv_waste_fraction() == pytest.approx(2 / 8)
    manager.fork(parent, parent.fork(1))  # sharing adds no slots
    assert manager.kv_waste_fraction() == pytest.approx(2 / 8)
    compute(manager, make_seq(2), 4)  # a full block
    assert manager.kv_waste_fraction() == pytest.approx(2 / 12)


def test_check_invariants_catches_corruption():
    manager = make_manager()
    manager.allocate_slots(make_seq(0), 4)
    manager.block_tables[0].append(manager.get_block_table(0)[0])
    with pytest.raises(AssertionError, match="ref count"):
        manager.check_invariants()


def test_check_invariants_catches_a_sequence_both_resident_and_swapped():
    manager = make_manager(num_cpu_blocks=4)
    seq = make_seq(0)
    manager.allocate_slots(seq, 4)
    manager.cpu_block_tables[0] = []
    with pytest.raises(AssertionError, match="both resident and swapped"):
        manager.check_invariants()


def test_a_burst_of_prompts_then_lockstep_decodes_keeps_each_table_one_run():
    """Eight prompts admitted together, then decoding in lockstep, crossing block ends at
    different steps: every sequence's blocks stay physically consecutive (attention reads
    them in order), where handing out blocks in order interleaves the decode blocks."""
    manager = make_manager(num_blocks=256, block_size=4)
    seqs = [make_seq(i, 9 + 3 * i) for i in range(8)]
    for seq in seqs:
        compute(manager, seq, seq.num_prompt_tokens)
    for _ in range(20):
        for seq in seqs:
            seq.append_token(7, None, None)
            compute(manager, seq, 1)
    for seq in seqs:
        table = manager.get_block_table(seq.seq_id)
        assert len(table) == manager.num_required_blocks(seq.num_computed_tokens)
        assert table == list(range(table[0], table[0] + len(table))), table
    manager.check_invariants()


def test_share_prefix_gives_a_sequence_the_first_blocks_of_another():
    # A recomputed sibling: it drops what it held and takes the first 2 of 3 full blocks.
    manager = make_manager(num_blocks=8, block_size=4)
    first = make_seq(0)
    compute(manager, first, 12)
    second = first.fork(1)
    compute(manager, second, 4)  # its own copy of the first block, say
    manager.share_prefix(first, second, 2)
    manager.check_invariants()
    assert manager.get_block_table(1) == manager.get_block_table(0)[:2]
    assert [manager.block_pool.ref_count(b) for b in manager.get_block_table(0)] == [2, 2, 1]
    assert manager.num_free_blocks == 8 - 3
    second.num_computed_tokens = 8
    compute(manager, second, 3)  # its own block after the shared ones
    assert manager.get_block_table(1)[:2] == manager.get_block_table(0)[:2]
    assert manager.num_free_blocks == 8 - 4
    manager.free(0)
    manager.free(1)
    manager.check_invariants()
    assert manager.num_free_blocks == 8
