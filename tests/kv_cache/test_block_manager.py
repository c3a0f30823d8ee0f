import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from serve.kv_cache.block_manager import BlockManager


def make_manager(num_blocks: int = 8, block_size: int = 4) -> BlockManager:
    manager = BlockManager(num_blocks=num_blocks, block_size=block_size)
    manager.check_invariants()
    return manager


@pytest.mark.parametrize(("num_tokens", "expected"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2)])
def test_num_required_blocks(num_tokens, expected):
    assert make_manager(block_size=4).num_required_blocks(num_tokens) == expected


def test_allocate_slots_grows_ceil_blocks():
    manager = make_manager(num_blocks=8, block_size=4)
    assert manager.num_new_blocks(0, 5) == 2
    assert manager.allocate_slots(0, 5)
    manager.check_invariants()
    assert len(manager.get_block_table(0)) == 2
    assert manager.num_new_blocks(0, 8) == 0
    assert manager.allocate_slots(0, 8)  # fills the last block, no new one
    assert len(manager.get_block_table(0)) == 2
    assert manager.allocate_slots(0, 9)
    manager.check_invariants()
    assert len(manager.get_block_table(0)) == 3
    assert manager.num_free_blocks == 5
    assert manager.usage == pytest.approx(3 / 8)


def test_allocate_slots_is_all_or_nothing():
    manager = make_manager(num_blocks=4, block_size=4)
    assert manager.allocate_slots(0, 8)
    assert not manager.can_allocate(1, 12)
    assert not manager.allocate_slots(1, 12)  # needs 3 blocks, 2 free
    manager.check_invariants()
    assert not manager.has_table(1)
    assert not manager.allocate_slots(0, 20)  # needs 3 more, 2 free
    manager.check_invariants()
    assert len(manager.get_block_table(0)) == 2
    assert manager.num_free_blocks == 2


def test_can_allocate_respects_watermark():
    manager = make_manager(num_blocks=4, block_size=4)
    assert manager.can_allocate(0, 16)
    assert not manager.can_allocate(0, 16, watermark_blocks=1)
    assert manager.can_allocate(0, 12, watermark_blocks=1)


def test_free_returns_all_blocks():
    manager = make_manager(num_blocks=8, block_size=4)
    manager.allocate_slots(0, 10)
    manager.allocate_slots(1, 3)
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
    manager.allocate_slots(0, 6)
    manager.fork(0, 1)
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
    manager.allocate_slots(0, 4)
    manager.allocate_slots(1, 4)
    with pytest.raises(ValueError):
        manager.fork(0, 1)
    manager.check_invariants()


def test_check_invariants_catches_corruption():
    manager = make_manager()
    manager.allocate_slots(0, 4)
    manager.block_tables[0].append(manager.get_block_table(0)[0])
    with pytest.raises(AssertionError, match="ref count"):
        manager.check_invariants()


SEQ_IDS = st.integers(min_value=0, max_value=4)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / fork / free over a few sequences, checked every step."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(num_blocks=16, block_size=4)
        self.num_tokens: dict[int, int] = {}  # what each live table must cover

    @rule(seq_id=SEQ_IDS, num_tokens=st.integers(min_value=1, max_value=40))
    def allocate(self, seq_id: int, num_tokens: int) -> None:
        if seq_id in self.num_tokens:
            return
        self._grow_to(seq_id, num_tokens)

    @precondition(lambda self: self.num_tokens)
    @rule(data=st.data(), k=st.integers(min_value=1, max_value=9))
    def append(self, data: st.DataObject, k: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.num_tokens)))
        self._grow_to(seq_id, self.num_tokens[seq_id] + k)

    @precondition(lambda self: self.num_tokens)
    @rule(data=st.data(), child_seq_id=SEQ_IDS)
    def fork(self, data: st.DataObject, child_seq_id: int) -> None:
        parent_seq_id = data.draw(st.sampled_from(sorted(self.num_tokens)))
        if child_seq_id in self.num_tokens:
            return
        num_free = self.manager.num_free_blocks
        self.manager.fork(parent_seq_id, child_seq_id)
        assert self.manager.num_free_blocks == num_free
        self.num_tokens[child_seq_id] = self.num_tokens[parent_seq_id]

    @rule(seq_id=SEQ_IDS)
    def free(self, seq_id: int) -> None:
        self.manager.free(seq_id)
        self.num_tokens.pop(seq_id, None)

    def _grow_to(self, seq_id: int, num_tokens: int) -> None:
        before = list(self.manager.block_tables.get(seq_id, []))
        num_new = self.manager.num_new_blocks(seq_id, num_tokens)
        expected_ok = self.manager.can_allocate(seq_id, num_tokens)
        assert self.manager.allocate_slots(seq_id, num_tokens) == expected_ok
        after = self.manager.block_tables.get(seq_id, [])
        if expected_ok:
            assert after[: len(before)] == before and len(after) == len(before) + num_new
            self.num_tokens[seq_id] = num_tokens
        else:
            assert after == before

    @invariant()
    def invariants_hold(self) -> None:
        self.manager.check_invariants()
        assert set(self.manager.block_tables) == set(self.num_tokens)
        for seq_id, num_tokens in self.num_tokens.items():
            table = self.manager.get_block_table(seq_id)
            assert len(table) == self.manager.num_required_blocks(num_tokens)

    def teardown(self) -> None:
        for seq_id in list(self.num_tokens):
            self.manager.free(seq_id)
            self.manager.check_invariants()
        assert self.manager.num_free_blocks == self.manager.num_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
