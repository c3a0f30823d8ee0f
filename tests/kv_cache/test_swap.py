"""Swapping a group's blocks to the CPU pool and back: sharing and prefixes survive."""

import pytest
from kv_cache.manager_helpers import allocation_state as snapshot
from kv_cache.manager_helpers import fork_into, prefilled

from serve.kv_cache.block_manager import BlockManager
from serve.kv_cache.block_pool import NoFreeBlocksError
from serve.sampling_params import SamplingParams
from serve.sequence import Sequence

BLOCK_SIZE = 4


def test_swap_round_trip_moves_one_sequence():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, num_cpu_blocks=4)
    seq = prefilled(manager, 10)
    device_table = list(manager.get_block_table(0))
    assert manager.num_swap_blocks([seq], swapped_out=False) == 3
    out = manager.swap_out([seq])
    manager.check_invariants()
    assert [device for device, _ in out] == device_table
    assert manager.is_swapped_out(0) and not manager.has_table(0)
    assert manager.cpu_block_tables[0] == [cpu for _, cpu in out]
    assert manager.num_free_blocks == 8 and manager.cpu_pool.num_free_blocks == 1
    back = manager.swap_in([seq])
    manager.check_invariants()
    assert [cpu for cpu, _ in back] == [cpu for _, cpu in out]
    assert manager.get_block_table(0) == [device for _, device in back]
    assert not manager.is_swapped_out(0)
    assert manager.num_free_blocks == 5 and manager.cpu_pool.num_free_blocks == 4


def test_a_block_shared_by_three_sequences_swaps_as_one_block():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, num_cpu_blocks=4)
    family = fork_into(manager, prefilled(manager, 6), 2)
    assert manager.num_swap_blocks(family, swapped_out=False) == 2
    out = manager.swap_out(family)
    manager.check_invariants()
    assert len(out) == 2
    cpu_tables = [manager.cpu_block_tables[s.seq_id] for s in family]
    assert cpu_tables[0] == cpu_tables[1] == cpu_tables[2]
    assert all(manager.cpu_pool.ref_count(b) == 3 for b in cpu_tables[0])
    assert manager.num_swap_blocks(family, swapped_out=True) == 2
    back = manager.swap_in(family)
    manager.check_invariants()
    assert len(back) == 2
    tables = [manager.get_block_table(s.seq_id) for s in family]
    assert tables[0] == tables[1] == tables[2]
    assert all(manager.block_pool.ref_count(b) == 3 for b in tables[0])
    assert manager.cpu_pool.num_free_blocks == 4


def test_partly_shared_tables_keep_their_shape():
    # Two siblings share a full block and each has its own last block.
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, num_cpu_blocks=8)
    family = fork_into(manager, prefilled(manager, 6), 1)
    for seq in family:
        seq.append_token(seq.seq_id, 0.0, None)
        manager.allocate_slots(seq, seq.num_tokens)
    manager.swap_out(family)
    (a0, a1), (b0, b1) = (manager.cpu_block_tables[s.seq_id] for s in family)
    assert a0 == b0 and a1 != b1
    manager.swap_in(family)
    (a0, a1), (b0, b1) = (manager.get_block_table(s.seq_id) for s in family)
    assert a0 == b0 and a1 != b1
    assert manager.block_pool.ref_count(a0) == 2
    manager.check_invariants()


@pytest.mark.parametrize("num_cpu_blocks", [0, 2])
def test_swap_out_refuses_when_the_cpu_pool_is_too_small_and_changes_nothing(num_cpu_blocks):
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, num_cpu_blocks=num_cpu_blocks)
    family = fork_into(manager, prefilled(manager, 10), 1)
    before = snapshot(manager)
    assert manager.swap_out(family) is None
    assert snapshot(manager) == before
    manager.check_invariants()


def test_swap_in_refuses_when_the_device_is_too_small_and_changes_nothing():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE, num_cpu_blocks=4)
    seq = prefilled(manager, 10)
    manager.swap_out([seq])
    prefilled(manager, 8, seq_id=1)  # 2 of 4 device blocks left, 3 needed
    before = snapshot(manager)
    with pytest.raises(NoFreeBlocksError):
        manager.swap_in([seq])
    assert snapshot(manager) == before


def test_freeing_a_swapped_out_sequence_frees_its_cpu_blocks():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, num_cpu_blocks=4)
    family = fork_into(manager, prefilled(manager, 6), 1)
    manager.swap_out(family)
    manager.free(0)
    assert manager.cpu_pool.num_free_blocks == 2
    manager.free(1)
    assert manager.cpu_pool.num_free_blocks == 4 and not manager.cpu_block_tables
    manager.check_invariants()


def test_swapped_in_blocks_serve_prefix_hits_again():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE, num_cpu_blocks=4)
    seq = prefilled(manager, 9)
    manager.swap_out([seq])
    # Evict the device copies the swap-out left cached.
    filler = prefilled(manager, 16, seq_id=1)
    manager.free(filler.seq_id)
    manager.swap_in([seq])
    probe = Sequence(2, "r2", seq.prompt_token_ids, SamplingParams(max_tokens=1))
    assert manager.find_cached_prefix(probe) == manager.get_block_table(0)[:2]


def test_check_invariants_covers_the_cpu_pool():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE, num_cpu_blocks=4)
    manager.swap_out([prefilled(manager, 4)])
    manager.cpu_block_tables[0].append(manager.cpu_block_tables[0][0])
    with pytest.raises(AssertionError, match="ref count"):
        manager.check_invariants()
