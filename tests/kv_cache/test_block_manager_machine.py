"""A hypothesis state machine over the BlockManager with a fake KV cache.

Random admit (with prefix reuse) / append / compute / fork / share a prefix / free /
swap-out / swap-in, where "KV content" is simulated: each physical block holds the token
ids written into its slots. `compute` writes a sequence's tokens into its table's slots,
copy-on-write copies and swaps copy block contents. After every operation each sequence's table must read back
its own tokens: so fork, copy-on-write, swap round trips and prefix-cache hits can never
hand a sequence another sequence's K/V.
"""

from __future__ import annotations

import itertools

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_cache.manager_helpers import allocation_state

from serve.kv_cache.block_manager import BlockManager
from serve.kv_cache.block_pool import NoFreeBlocksError
from serve.kv_cache.prefix_cache import ROOT_HASH, hash_block
from serve.sampling_params import SamplingParams
from serve.sequence import Sequence

BLOCK_SIZE = 4
NUM_BLOCKS = 16
NUM_CPU_BLOCKS = 8
# A small alphabet, so unrelated prompts share prefixes too.
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)

Content = dict[int, list[int | None]]  # block id -> the token written in each slot


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS)
        self.seqs: dict[int, Sequence] = {}  # live sequences (resident or swapped out)
        self.seen: list[list[int]] = []  # token lists of every sequence so far, freed too
        self.device: Content = {b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}
        self.cpu: Content = {b: [None] * BLOCK_SIZE for b in range(NUM_CPU_BLOCKS)}
        # prefix hash -> the tokens of the full block it names (for every block ever full)
        self.block_of_hash: dict[bytes, tuple[int, ...]] = {}
        self.ids = itertools.count()

    # -- helpers ---------------------------------------------------------------------------

    def resident(self) -> list[int]:
        return sorted(self.manager.block_tables)

    def swapped(self) -> list[int]:
        return sorted(self.manager.cpu_block_tables)

    def new_seq(self, tokens: list[int]) -> Sequence:
        seq_id = next(self.ids)
        return Sequence(seq_id, f"r{seq_id}", tokens, SamplingParams(max_tokens=64))

    def read(self, content: Content, table: list[int], num_tokens: int) -> list[int | None]:
        return [content[table[i // BLOCK_SIZE]][i % BLOCK_SIZE] for i in range(num_tokens)]

    def note_hashes(self, tokens: list[int]) -> None:
        parent = ROOT_HASH
        for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
            block = tuple(tokens[start : start + BLOCK_SIZE])
            parent = hash_block(parent, block)
            self.block_of_hash[parent] = block

    def compute(self, seq: Sequence, num_new: int) -> None:
        """One scheduler step for `seq`: allocate, apply the copies, write, mark computed."""
        manager, pool = self.manager, self.manager.block_pool
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        before = allocation_state(manager)
        old_table = list(manager.block_tables.get(seq.seq_id, []))
        needed = manager.num_blocks_needed([(seq, end)])
        fits = manager.can_allocate([(seq, end)])
        assert fits == (needed <= manager.num_free_blocks)
        if not fits:
            try:
                manager.allocate_slots(seq, end)
            except NoFreeBlocksError:
                assert allocation_state(manager) == before
                return
            raise AssertionError("allocate_slots succeeded without enough free blocks")
        ref_counts = {b: pool.ref_count(b) for b in old_table}
        num_free = manager.num_free_blocks
        copies = manager.allocate_slots(seq, end)
        assert num_free - manager.num_free_blocks == needed
        table = manager.get_block_table(seq.seq_id)
        assert len(table) == manager.num_required_blocks(end)
        # Only the block the write starts in may be copied: a shared, partly filled one.
        assert len(copies) <= 1
        expected = list(old_table)
        for src, dst in copies:
            assert start % BLOCK_SIZE != 0, f"full shared block {src} copied"
            assert src == old_table[start // BLOCK_SIZE] and ref_counts[src] > 1
            expected[start // BLOCK_SIZE] = dst
            self.device[dst] = list(self.device[src])
            event("copy-on-write")
        assert table[: len(old_table)] == expected
        for pos in range(start, end):
            block_id = table[pos // BLOCK_SIZE]
            assert pool.ref_count(block_id) == 1, f"write into shared block {block_id}"
            assert pool.hash_of(block_id) is None, f"write into named block {block_id}"
            self.device[block_id][pos % BLOCK_SIZE] = seq.token_at(pos)
        seq.num_computed_tokens = end
        manager.mark_computed(seq)
        self.note_hashes(seq.token_ids_between(0, end))

    # -- rules -----------------------------------------------------------------------------

    @rule(data=st.data(), suffix=TOKENS, reuse=st.booleans())
    def admit(self, data: st.DataObject, suffix: list[int], reuse: bool) -> None:
        """A new sequence: fresh tokens, or a prefix of a live or freed one plus a suffix."""
        prefix: list[int] = []
        if reuse and self.seen:
            tokens = data.draw(st.sampled_from(self.seen))
            prefix = tokens[: data.draw(st.integers(0, len(tokens)))]
        seq = self.new_seq(prefix + suffix)
        manager = self.manager
        hits = manager.find_cached_prefix(seq)
        assert len(hits) * BLOCK_SIZE < seq.num_tokens  # never the last token
        # A hit's blocks hold exactly the prompt's prefix.
        assert self.read(self.device, hits, len(hits) * BLOCK_SIZE) == (
            seq.token_ids_between(0, len(hits) * BLOCK_SIZE)
        )
        event(f"prefix hit: {len(hits) > 0}")
        needed = manager.num_blocks_to_admit([(hits, seq.num_tokens)])
        if needed > manager.num_free_blocks:
            return
        num_free = manager.num_free_blocks
        seq.num_computed_tokens = manager.take_cached_prefix(seq, hits)
        self.seqs[seq.seq_id] = seq
        self.seen.append(seq.all_token_ids)
        self.compute(seq, seq.num_uncomputed_tokens)
        assert num_free - manager.num_free_blocks == needed
        assert seq.num_computed_tokens == seq.num_tokens

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), new_tokens=TOKENS)
    def append(self, data: st.DataObject, new_tokens: list[int]) -> None:
        """Sample tokens (not computed yet): the engine appends, the next step computes."""
        seq = self.seqs[data.draw(st.sampled_from(self.resident()))]
        for token in new_tokens:
            seq.append_token(token, 0.0, None)

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        """An engine step for a sequence: sample one token, compute what is pending."""
        seq = self.seqs[data.draw(st.sampled_from(self.resident()))]
        seq.append_token(token, 0.0, None)
        self.compute(seq, seq.num_uncomputed_tokens)

    @precondition(lambda self: any(self.seqs[s].num_uncomputed_tokens for s in self.resident()))
    @rule(data=st.data())
    def compute_some(self, data: st.DataObject) -> None:
        pending = [s for s in self.resident() if self.seqs[s].num_uncomputed_tokens]
        seq = self.seqs[data.draw(st.sampled_from(pending))]
        self.compute(seq, data.draw(st.integers(1, seq.num_uncomputed_tokens)))

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.seqs[data.draw(st.sampled_from(self.resident()))]
        child = parent.fork(next(self.ids))
        num_free = self.manager.num_free_blocks
        self.manager.fork(parent, child)
        assert self.manager.num_free_blocks == num_free
        self.seqs[child.seq_id] = child

    @precondition(lambda self: len(self.resident()) > 1)
    @rule(data=st.data())
    def share_prefix(self, data: st.DataObject) -> None:
        """A sequence recomputed after another: it starts over from the full blocks of the
        prefix it shares with the other's computed tokens."""
        src_id, dst_id = data.draw(st.permutations(self.resident()))[:2]
        src, dst = self.seqs[src_id], self.seqs[dst_id]
        limit = min(src.num_computed_tokens, dst.num_tokens - 1)
        common = 0
        while common < limit and src.token_at(common) == dst.token_at(common):
            common += 1
        if common < BLOCK_SIZE:
            return
        num_blocks = data.draw(st.integers(1, common // BLOCK_SIZE))
        manager = self.manager
        held = manager.block_pool.held_ref_counts()
        dropped = [b for b in manager.get_block_table(dst_id) if held[b] == 1]
        gained = manager.get_block_table(src_id)[:num_blocks]
        manager.share_prefix(src, dst, num_blocks)
        dst.num_computed_tokens = num_blocks * BLOCK_SIZE
        assert manager.get_block_table(dst_id) == gained
        assert manager.block_pool.num_used_blocks == len(held) - len(dropped)
        event("shares one block" if num_blocks == 1 else "shares several blocks")

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = self.seqs.pop(data.draw(st.sampled_from(sorted(self.seqs))))
        self.seen.append(seq.all_token_ids)
        self.manager.free(seq.seq_id)
        assert not self.manager.has_table(seq.seq_id)
        assert not self.manager.is_swapped_out(seq.seq_id)

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        ids = data.draw(st.sets(st.sampled_from(self.resident()), min_size=1))
        seqs = [self.seqs[s] for s in sorted(ids)]
        manager = self.manager
        num_moved = manager.num_swap_blocks(seqs, swapped_out=False)
        num_cpu_free = manager.cpu_pool.num_free_blocks
        before = allocation_state(manager)
        copies = manager.swap_out(seqs)
        if num_moved > num_cpu_free:
            assert copies is None and allocation_state(manager) == before
            event("swap-out refused")
            return
        assert copies is not None and len(copies) == num_moved
        assert len({cpu for _, cpu in copies}) == num_moved
        for device_block, cpu_block in copies:
            self.cpu[cpu_block] = list(self.device[device_block])
        event(f"swap-out shares blocks: {num_moved < sum(len(before[0][s]) for s in ids)}")

    @precondition(lambda self: self.swapped())
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        ids = data.draw(st.sets(st.sampled_from(self.swapped()), min_size=1))
        seqs = [self.seqs[s] for s in sorted(ids)]
        manager = self.manager
        num_moved = manager.num_swap_blocks(seqs, swapped_out=True)
        if num_moved > manager.num_free_blocks:
            before = allocation_state(manager)
            try:
                manager.swap_in(seqs)
            except NoFreeBlocksError:
                assert allocation_state(manager) == before
                return
            raise AssertionError("swap_in succeeded without enough free blocks")
        copies = manager.swap_in(seqs)
        event("swap-in")
        assert len(copies) == num_moved
        for cpu_block, device_block in copies:
            self.device[device_block] = list(self.cpu[cpu_block])

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def ref_counts_equal_holders(self) -> None:
        self.manager.check_invariants()
        for pool, tables in (
            (self.manager.block_pool, self.manager.block_tables),
            (self.manager.cpu_pool, self.manager.cpu_block_tables),
        ):
            held = {b for table in tables.values() for b in table}
            assert not held & set(pool.free_block_ids), "a block is both free and held"
        assert set(self.manager.block_tables) | set(self.manager.cpu_block_tables) == set(self.seqs)

    @invariant()
    def every_table_reads_back_its_tokens(self) -> None:
        for seq in self.seqs.values():
            n = seq.num_computed_tokens
            if self.manager.has_table(seq.seq_id):
                content, table = self.device, self.manager.get_block_table(seq.seq_id)
            else:
                content, table = self.cpu, self.manager.cpu_block_tables[seq.seq_id]
            assert len(table) == self.manager.num_required_blocks(n)
            assert self.read(content, table, n) == seq.token_ids_between(0, n), (
                f"seq {seq.seq_id}'s KV differs from its tokens"
            )

    @invariant()
    def named_blocks_hold_their_prefix(self) -> None:
        pool = self.manager.block_pool
        for block_id in range(NUM_BLOCKS):
            block_hash = pool.hash_of(block_id)
            if block_hash is not None:
                assert tuple(self.device[block_id]) == self.block_of_hash[block_hash]

    def teardown(self) -> None:
        manager = self.manager
        for seq_id in list(self.seqs):
            manager.free(seq_id)
            manager.check_invariants()
        assert manager.num_free_blocks == NUM_BLOCKS
        assert manager.cpu_pool.num_free_blocks == NUM_CPU_BLOCKS
        assert not manager.block_tables and not manager.cpu_block_tables
        # Cached blocks are free: a fresh sequence can take every block.
        fresh = self.new_seq([7] * (NUM_BLOCKS * BLOCK_SIZE))
        manager.allocate_slots(fresh, fresh.num_tokens)
        assert manager.block_pool.num_cached_blocks == 0
        manager.free(fresh.seq_id)
        manager.check_invariants()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
