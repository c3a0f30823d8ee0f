"""Block tables: each sequence's logical KV blocks mapped onto physical blocks.

`BlockManager` is the only writer of block tables and (through `BlockPool`) of ref
counts, so `check_invariants` can verify the whole allocation state in one place.
"""

from collections import Counter

from serve.kv_cache.block_pool import BlockPool


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        # seq_id -> physical block ids, in logical order.
        self.block_tables: dict[int, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of physical blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_required_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks to add so seq_id's table covers `num_tokens` tokens in total."""
        num_held = len(self.block_tables.get(seq_id, ()))
        return max(0, self.num_required_blocks(num_tokens) - num_held)

    def can_allocate(self, seq_id: int, num_tokens: int, watermark_blocks: int = 0) -> bool:
        """Whether `allocate_slots(seq_id, num_tokens)` would succeed and still leave
        `watermark_blocks` free (headroom that avoids immediate preemption)."""
        return self.num_new_blocks(seq_id, num_tokens) <= self.num_free_blocks - watermark_blocks

    def allocate_slots(self, seq_id: int, num_tokens: int) -> bool:
        """Grow seq_id's table to cover `num_tokens` tokens in total.

        All-or-nothing: returns False and changes nothing if there are too few free blocks.
        """
        num_new = self.num_new_blocks(seq_id, num_tokens)
        if num_new > self.num_free_blocks:
            return False
        block_table = self.block_tables.setdefault(seq_id, [])
        block_table.extend(self.block_pool.allocate() for _ in range(num_new))
        return True

    def free(self, seq_id: int) -> None:
        """Release every block of seq_id's table and delete it; unknown ids are a no-op."""
        # Free in reverse so a sequence's tail blocks return to the pool first.
        for block_id in reversed(self.block_tables.pop(seq_id, [])):
            self.block_pool.free(block_id)

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Give the child a table sharing every parent block (copy-on-write comes later)."""
        if child_seq_id in self.block_tables:
            raise ValueError(f"fork target seq {child_seq_id} already has a block table")
        parent_table = self.block_tables[parent_seq_id]
        for block_id in parent_table:
            self.block_pool.incref(block_id)
        self.block_tables[child_seq_id] = list(parent_table)

    def get_block_table(self, seq_id: int) -> list[int]:
        return self.block_tables[seq_id]

    def has_table(self, seq_id: int) -> bool:
        return seq_id in self.block_tables

    def check_invariants(self) -> None:
        """Assert the ref counts and free list agree with the block tables."""
        pool = self.block_pool
        holders = Counter(b for table in self.block_tables.values() for b in table)
        unknown = set(holders) - set(range(pool.num_blocks))
        assert not unknown, f"block tables hold out-of-range block ids {sorted(unknown)}"
        for block_id in range(pool.num_blocks):
            ref_count = pool.ref_count(block_id)
            assert ref_count >= 0, f"block {block_id} has negative ref count {ref_count}"
            assert ref_count == holders[block_id], (
                f"block {block_id}: ref count {ref_count} != {holders[block_id]} tables holding it"
            )
        free_ids = pool.free_block_ids
        assert len(free_ids) == len(set(free_ids)), f"free list has duplicates: {free_ids}"
        zero_ref = {b for b in range(pool.num_blocks) if pool.ref_count(b) == 0}
        assert set(free_ids) == zero_ref, (
            f"free list {sorted(free_ids)} != blocks with ref count 0 {sorted(zero_ref)}"
        )
        assert pool.num_free_blocks + len(holders) == pool.num_blocks, (
            f"{pool.num_free_blocks} free + {len(holders)} used != {pool.num_blocks} blocks"
        )
