"""Automatic prefix caching: chained block hashes, hits, LRU eviction, counters."""

import pytest

from serve.kv_cache.block_manager import BlockManager
from serve.kv_cache.prefix_cache import ROOT_HASH, hash_block
from serve.sampling_params import SamplingParams
from serve.sequence import Sequence

BLOCK_SIZE = 4


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", tokens, SamplingParams(max_tokens=4))


def admit(manager: BlockManager, seq: Sequence) -> list[int]:
    """Admit `seq` as the scheduler does: take its cached prefix, compute the rest.
    Returns the cached blocks it took."""
    hits = manager.find_cached_prefix(seq)
    seq.num_computed_tokens = manager.take_cached_prefix(seq, hits)
    manager.allocate_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.mark_computed(seq)
    manager.check_invariants()
    return hits


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_hash_block_is_chained_and_deterministic():
    h = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert h == hash_block(ROOT_HASH, (1, 2, 3, 4))
    assert h != hash_block(ROOT_HASH, [1, 2, 3, 5])
    assert hash_block(h, [5, 6, 7, 8]) != hash_block(ROOT_HASH, [5, 6, 7, 8])
    assert hash_block(ROOT_HASH, [1, 2]) != hash_block(ROOT_HASH, [1, 2, 0])


def test_same_prompt_twice_hits_every_full_block_but_the_last_token():
    manager = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    first = make_seq(0, tokens(100, 10))
    assert admit(manager, first) == []
    second = make_seq(1, tokens(100, 10))
    hits = admit(manager, second)
    assert hits == manager.get_block_table(0)[:2]  # 8 of 10 tokens; the partial block is not
    assert manager.get_block_table(1)[:2] == hits
    assert manager.get_block_table(1)[2] != manager.get_block_table(0)[2]
    assert all(manager.block_pool.ref_count(b) == 2 for b in hits)
    assert (manager.prefix_cache.queries, manager.prefix_cache.hits) == (20, 8)


def test_a_freed_prompt_is_still_cached():
    manager = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    first = make_seq(0, tokens(100, 10))
    admit(manager, first)
    held = manager.get_block_table(0)[:2]
    manager.free(0)
    assert manager.block_pool.num_cached_blocks == 2
    assert manager.num_blocks_to_admit([(held, 10)]) == 2 + 1  # two revived, one new
    hits = admit(manager, make_seq(1, tokens(100, 10)))
    assert hits == held
    assert manager.block_pool.num_cached_blocks == 0


def test_block_aligned_prompt_leaves_its_last_block_to_compute():
    # 8 tokens: both blocks are cached, but the last token must run to give the logits.
    manager = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    admit(manager, make_seq(0, tokens(100, 8)))
    assert len(manager.find_cached_prefix(make_seq(1, tokens(100, 8)))) == 1
    assert len(manager.find_cached_prefix(make_seq(2, tokens(100, 9)))) == 2


def test_shared_system_prompt_with_different_suffixes():
    manager = BlockManager(num_blocks=32, block_size=BLOCK_SIZE)
    system = tokens(500, 8)
    first = make_seq(0, system + [1, 2, 3])
    admit(manager, first)
    for seq_id, suffix in enumerate(([4, 5, 6, 7, 8], [9]), start=1):
        seq = make_seq(seq_id, system + suffix)
        hits = admit(manager, seq)
        assert hits == manager.get_block_table(0)[:2]
        assert seq.num_computed_tokens == seq.num_tokens
    assert manager.prefix_cache.hits == 8 + 8


def test_prefix_ending_mid_block_hits_only_full_blocks():
    manager = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    admit(manager, make_seq(0, tokens(100, 12)))
    # The first 6 tokens agree: block 0 is shared, block 1 differs from its 3rd token on.
    other = make_seq(1, tokens(100, 6) + [0, 0, 0, 0, 0, 0])
    hits = admit(manager, other)
    assert hits == manager.get_block_table(0)[:1]
    assert manager.prefix_cache.hits == 4


def test_a_different_first_block_hits_nothing_after_it():
    manager = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    admit(manager, make_seq(0, tokens(100, 12)))
    # Block 1 has the same tokens, but the chain differs from block 0 on.
    assert manager.find_cached_prefix(make_seq(1, [0, 0, 0, 0] + tokens(104, 8))) == []


def test_only_computed_full_blocks_are_registered():
    manager = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    seq = make_seq(0, tokens(100, 12))
    manager.allocate_slots(seq, 6)
    assert manager.find_cached_prefix(make_seq(1, tokens(100, 12))) == []  # not computed yet
    seq.num_computed_tokens = 6
    manager.mark_computed(seq)
    assert len(manager.find_cached_prefix(make_seq(2, tokens(100, 12)))) == 1
    manager.allocate_slots(seq, 12)
    seq.num_computed_tokens = 12
    manager.mark_computed(seq)
    assert len(manager.find_cached_prefix(make_seq(3, tokens(100, 13)))) == 3


def test_duplicate_computation_keeps_the_first_block_named():
    # Two equal prompts admitted in the same step both compute their blocks.
    manager = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    first, second = make_seq(0, tokens(100, 9)), make_seq(1, tokens(100, 9))
    for seq in (first, second):
        manager.allocate_slots(seq, 9)
    for seq in (first, second):
        seq.num_computed_tokens = 9
        manager.mark_computed(seq)
    manager.check_invariants()
    assert (
        manager.find_cached_prefix(make_seq(2, tokens(100, 9))) == (manager.get_block_table(0)[:2])
    )
    manager.free(0)
    manager.free(1)
    assert manager.block_pool.num_cached_blocks == 2


def test_lru_eviction_least_recently_freed_first_tail_before_head():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    a, b = make_seq(0, tokens(100, 12)), make_seq(1, tokens(200, 12))
    admit(manager, a)
    admit(manager, b)
    table_a, table_b = manager.get_block_table(0), manager.get_block_table(1)
    manager.free(0)
    manager.free(1)
    assert manager.block_pool.num_cached_blocks == 6

    probe_ids = iter(range(100, 200))  # the manager memoises hashes per sequence id

    def num_hits(prompt: list[int]) -> int:  # one token more: all 3 blocks may hit
        return len(manager.find_cached_prefix(make_seq(next(probe_ids), prompt + [0])))

    assert manager.block_pool.free_block_ids == tuple(table_a[::-1] + table_b[::-1])
    fresh = make_seq(2, tokens(300, 12))
    evicted = []
    for n in range(1, 7):
        manager.allocate_slots(fresh, n * BLOCK_SIZE)
        evicted.append(manager.get_block_table(2)[-1])
        assert (num_hits(a.prompt_token_ids), num_hits(b.prompt_token_ids)) == (
            max(0, 3 - n),
            min(3, 6 - n),
        )
    assert evicted == table_a[::-1] + table_b[::-1]
    manager.check_invariants()


def test_a_hit_refreshes_the_blocks_it_revives():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    admit(manager, make_seq(0, tokens(100, 8)))
    admit(manager, make_seq(1, tokens(200, 8)))
    manager.free(0)
    manager.free(1)
    again = make_seq(2, tokens(100, 5))  # hits seq 0's first block, then frees it last
    assert admit(manager, again) == manager.get_block_table(2)[:1]
    manager.free(2)
    fresh = make_seq(3, tokens(300, 20))
    # Takes the two clean blocks (never used, or released unnamed), then evicts 3 of the
    # 4 cached ones, least recently released first: seq 0's head survives.
    manager.allocate_slots(fresh, 20)
    assert len(manager.find_cached_prefix(make_seq(4, tokens(100, 5)))) == 1
    assert manager.find_cached_prefix(make_seq(5, tokens(200, 5))) == []


def test_hit_counters_are_in_tokens():
    manager = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    admit(manager, make_seq(0, tokens(100, 7)))
    admit(manager, make_seq(1, tokens(100, 9)))
    admit(manager, make_seq(2, tokens(900, 3)))
    assert manager.prefix_cache.queries == 7 + 9 + 3
    assert manager.prefix_cache.hits == 4


def test_a_preempted_sequences_return_is_not_counted():
    """Counted once per request, its prompt: a sequence recomputed after a preemption
    would add its outputs as queries and the blocks it computed itself as hits."""
    manager = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    seq = make_seq(0, tokens(100, 7))
    admit(manager, seq)
    for token_id in (7, 8, 9):  # decoded: the K/V of all but the last output
        seq.append_token(token_id, 0.0, None)
    manager.allocate_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens - 1
    manager.mark_computed(seq)
    manager.free(0)  # a recompute preemption
    seq.num_computed_tokens = 0
    hits = manager.find_cached_prefix(seq)
    assert len(hits) == 2  # its prompt's block and the one its outputs filled
    assert manager.take_cached_prefix(seq, hits, was_preempted=True) == 8
    assert (manager.prefix_cache.queries, manager.prefix_cache.hits) == (7, 0)


def test_fork_shares_registered_blocks():
    manager = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)
    parent = make_seq(0, tokens(100, 6))
    admit(manager, parent)
    child = parent.fork(1)
    manager.fork(parent, child)
    child.append_token(7, 0.0, None)
    child.append_token(8, 0.0, None)
    manager.allocate_slots(child, 8)
    child.num_computed_tokens = 8
    manager.mark_computed(child)
    manager.check_invariants()
    # The child's second block (copied on write, then filled) is now cached too.
    hits = manager.find_cached_prefix(make_seq(2, tokens(100, 6) + [7, 8, 0]))
    assert hits == manager.get_block_table(1)[:2]


@pytest.mark.parametrize("num_tokens", [3, 9, 16])
def test_disabled_prefix_caching_never_hits(num_tokens):
    manager = BlockManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    admit(manager, make_seq(0, tokens(100, num_tokens)))
    assert admit(manager, make_seq(1, tokens(100, num_tokens))) == []
    manager.free(0)
    manager.free(1)
    assert manager.block_pool.num_cached_blocks == 0
    assert admit(manager, make_seq(2, tokens(100, num_tokens))) == []
    assert (manager.prefix_cache.queries, manager.prefix_cache.hits) == (0, 0)
