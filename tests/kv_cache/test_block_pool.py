import pytest

from serve.kv_cache.block_pool import BlockPool, NoFreeBlocksError

H1, H2 = b"hash-1", b"hash-2"


def test_rejects_negative_size_allows_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(-1)
    pool = BlockPool(0)  # an empty CPU swap space
    assert pool.num_blocks == pool.num_free_blocks == pool.num_used_blocks == 0
    pool.check_invariants()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_allocate_until_exhausted_then_raises():
    pool = BlockPool(3)
    block_ids = [pool.allocate() for _ in range(3)]
    assert sorted(block_ids) == [0, 1, 2]
    assert all(pool.ref_count(b) == 1 for b in block_ids)
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 3
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    pool.check_invariants()


def test_free_returns_block_to_back_of_free_list():
    pool = BlockPool(3)
    first = pool.allocate()
    pool.free(first)
    assert pool.num_free_blocks == 3
    assert pool.free_block_ids[-1] == first
    assert pool.allocate() != first
    pool.check_invariants()


def test_double_free_raises():
    pool = BlockPool(2)
    block_id = pool.allocate()
    pool.free(block_id)
    with pytest.raises(ValueError):
        pool.free(block_id)
    assert pool.num_free_blocks == 2
    pool.check_invariants()


def test_incref_keeps_block_until_last_free():
    pool = BlockPool(2)
    block_id = pool.allocate()
    pool.incref(block_id)
    assert pool.ref_count(block_id) == 2
    pool.free(block_id)
    assert pool.ref_count(block_id) == 1
    assert pool.num_free_blocks == 1
    pool.free(block_id)
    assert pool.ref_count(block_id) == 0 and pool.is_free(block_id)
    assert pool.num_free_blocks == 2
    pool.check_invariants()


def test_incref_of_free_uncached_block_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.incref(0)
    pool.check_invariants()


def test_out_of_range_block_id_raises():
    pool = BlockPool(2)
    with pytest.raises(IndexError):
        pool.ref_count(2)
    with pytest.raises(IndexError):
        pool.free(-1)


# -- prefix cache --------------------------------------------------------------------------


def test_cached_block_stays_named_when_freed_and_revives_on_incref():
    pool = BlockPool(3)
    block_id = pool.allocate()
    pool.cache(block_id, H1)
    assert pool.lookup(H1) == block_id and pool.hash_of(block_id) == H1
    assert pool.num_cached_blocks == 0  # held, not cached-free
    pool.free(block_id)
    assert pool.is_free(block_id) and pool.lookup(H1) == block_id
    assert pool.num_cached_blocks == 1 and pool.num_free_blocks == 3
    pool.incref(block_id)  # a prefix-cache hit takes it back out of the free list
    assert pool.ref_count(block_id) == 1 and block_id not in pool.free_block_ids
    assert pool.num_free_blocks == 2 and pool.num_cached_blocks == 0
    pool.check_invariants()


def test_allocation_evicts_least_recently_freed_and_forgets_its_hash():
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    pool.cache(a, H1)
    pool.cache(b, H2)
    pool.free(b)
    pool.free(a)  # b was freed first: it goes first
    assert pool.free_block_ids == (b, a)
    assert pool.allocate() == b
    assert pool.lookup(H2) is None and pool.hash_of(b) is None
    assert pool.lookup(H1) == a and pool.num_cached_blocks == 1
    pool.check_invariants()


def test_cache_keeps_the_first_block_of_a_hash():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.cache(a, H1)
    pool.cache(b, H1)  # a duplicate computed before the first was registered
    assert pool.lookup(H1) == a and pool.hash_of(b) is None
    pool.cache(a, H2)  # a named block keeps its name
    assert pool.hash_of(a) == H1 and pool.lookup(H2) is None
    pool.check_invariants()


def test_cache_of_free_block_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.cache(0, H1)


def test_peak_usage_and_reset():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(3)]
    assert pool.peak_num_used == 3
    for block_id in blocks:
        pool.free(block_id)
    assert pool.num_used_blocks == 0 and pool.peak_num_used == 3
    pool.reset_peak()
    assert pool.peak_num_used == 0
    pool.allocate()
    assert pool.peak_num_used == 1


def test_peak_counts_revived_cached_blocks():
    pool = BlockPool(2)
    block_id = pool.allocate()
    pool.cache(block_id, H1)
    pool.free(block_id)
    pool.reset_peak()
    pool.incref(block_id)
    assert pool.peak_num_used == 1


def test_check_invariants_catches_corruption():
    pool = BlockPool(2)
    block_id = pool.allocate()
    pool._ref_counts[block_id] = 0  # held by nobody, yet not on the free list
    with pytest.raises(AssertionError, match="free blocks"):
        pool.check_invariants()


# -- placing in runs (the device pool) ------------------------------------------------------


def grow(pool: BlockPool, table: list[int]) -> None:
    table.append(pool.allocate(after=table[-1] if table else None))


def test_sequences_growing_in_turn_each_keep_one_run():
    """Four sequences start, then grow one block each in turn (decodes in lockstep): each
    new run starts in the middle of the longest clean stretch, so each grows in place."""
    pool = BlockPool(64, place_in_runs=True)
    tables: list[list[int]] = [[] for _ in range(4)]
    for table in tables:
        grow(pool, table)
    assert [t[0] for t in tables] == [0, 32, 16, 48]  # halving the room each time
    for _ in range(10):
        for table in tables:
            grow(pool, table)
    assert tables == [list(range(t[0], t[0] + 11)) for t in tables]
    pool.check_invariants()


def test_a_run_that_meets_a_held_block_goes_on_in_the_longest_clean_stretch():
    pool = BlockPool(16, place_in_runs=True)
    first = [pool.allocate(after=None) for _ in range(1)]
    second = [pool.allocate(after=None)]  # the middle of [1, 16): block 8
    assert second == [8]
    for _ in range(7):
        grow(pool, first)  # fills 1..7, then meets block 8
    assert first == list(range(8))
    grow(pool, first)  # [9, 16) follows held block 8: its middle
    assert first[-1] == 12
    pool.check_invariants()


def test_a_stretch_after_a_free_block_is_taken_from_its_start():
    pool = BlockPool(8, place_in_runs=True)
    blocks = [pool.allocate(after=b) for b in (None, 0, 1)]  # 0, 1, 2
    pool.cache(blocks[1], H1)
    for b in blocks:
        pool.free(b)
    # Clean: 0, 2..7 (block 1 keeps a prefix). The longest clean stretch [2, 8) follows a
    # free block, which nobody grows into: it is taken from its start.
    assert pool.allocate(after=None) == 2
    pool.check_invariants()


def test_clean_blocks_go_before_cached_ones_which_go_least_recent_first():
    pool = BlockPool(4, place_in_runs=True)
    blocks = [pool.allocate(after=b) for b in (None, 0, 1, 2)]
    for b, h in zip(blocks[:3], (H1, H2, b"hash-3")):
        pool.cache(b, h)
    for b in (blocks[2], blocks[0], blocks[3], blocks[1]):  # released in this order
        pool.free(b)
    assert pool.num_cached_blocks == 3
    # Block 3 is the only clean one; then the cached ones in release order: 2, 0, 1.
    taken = [pool.allocate(after=None) for _ in range(4)]
    assert taken == [3, 2, 0, 1]
    assert pool.lookup(H1) is None and pool.lookup(H2) is None
    pool.check_invariants()


def test_clean_map_follows_prefix_hits_and_evictions():
    """A cached block revived by a hit, and a duplicate hash that stays unnamed (clean
    once released): the invariant check compares the clean map with the free list."""
    pool = BlockPool(3, place_in_runs=True)
    a, b = pool.allocate(), pool.allocate(after=0)
    pool.cache(a, H1)
    pool.cache(b, H1)  # a duplicate: b stays unnamed
    pool.free(a)
    pool.free(b)
    assert pool.num_cached_blocks == 1
    pool.check_invariants()
    pool.incref(pool.lookup(H1))
    pool.check_invariants()
    assert pool.ref_count(a) == 1 and pool.num_free_blocks == 2


@pytest.mark.parametrize("place_in_runs", [False, True])
def test_reset_prefix_cache_forgets_prefixes_only_when_nothing_is_held(place_in_runs):
    pool = BlockPool(4, place_in_runs)
    a, b = pool.allocate(), pool.allocate()
    pool.cache(a, H1)
    pool.cache(b, H2)
    pool.free(a)
    assert not pool.reset_prefix_cache()  # b is held: nothing forgotten
    assert pool.lookup(H1) == a and pool.num_cached_blocks == 1
    pool.free(b)
    assert pool.reset_prefix_cache()
    assert pool.lookup(H1) is None and pool.lookup(H2) is None
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 4
    pool.check_invariants()
    assert sorted(pool.allocate() for _ in range(4)) == [0, 1, 2, 3]
