import pytest

from serve.kv_cache.block_pool import BlockPool, NoFreeBlocksError


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_until_exhausted_then_raises():
    pool = BlockPool(3)
    block_ids = [pool.allocate() for _ in range(3)]
    assert sorted(block_ids) == [0, 1, 2]
    assert all(pool.ref_count(b) == 1 for b in block_ids)
    assert pool.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_free_returns_block_to_back_of_free_list():
    pool = BlockPool(3)
    first = pool.allocate()
    pool.free(first)
    assert pool.num_free_blocks == 3
    assert pool.free_block_ids[-1] == first
    assert pool.allocate() != first


def test_double_free_raises():
    pool = BlockPool(2)
    block_id = pool.allocate()
    pool.free(block_id)
    with pytest.raises(ValueError):
        pool.free(block_id)
    assert pool.num_free_blocks == 2


def test_incref_keeps_block_until_last_free():
    pool = BlockPool(2)
    block_id = pool.allocate()
    pool.incref(block_id)
    assert pool.ref_count(block_id) == 2
    pool.free(block_id)
    assert pool.ref_count(block_id) == 1
    assert pool.num_free_blocks == 1
    pool.free(block_id)
    assert pool.ref_count(block_id) == 0
    assert pool.num_free_blocks == 2


def test_incref_of_free_block_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.incref(0)


def test_out_of_range_block_id_raises():
    pool = BlockPool(2)
    with pytest.raises(IndexError):
        pool.ref_count(2)
    with pytest.raises(IndexError):
        pool.free(-1)
