"""The physical KV blocks: which are free, and how many block tables hold each one."""

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised by `BlockPool.allocate` when every block is in use."""


class BlockPool:
    """Owns the free list and per-block ref counts of `num_blocks` physical blocks.

    Blocks are allocated from the left of the free list and freed blocks are appended to
    the right, so a just-freed block is reused last (useful once prefix caching keeps
    freed blocks' contents around).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._ref_counts: list[int] = [0] * num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """Snapshot of the free list, in allocation order (for invariant checks)."""
        return tuple(self._free_block_ids)

    def allocate(self) -> int:
        """Take a free block; it starts with ref count 1."""
        if not self._free_block_ids:
            raise NoFreeBlocksError(f"all {self.num_blocks} KV blocks are in use")
        block_id = self._free_block_ids.popleft()
        self._ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        """Add a holder to an allocated block (a forked or prefix-sharing table)."""
        if self.ref_count(block_id) < 1:
            raise ValueError(f"incref of free block {block_id}")
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one holder; the block returns to the free list when none remain."""
        if self.ref_count(block_id) < 1:
            raise ValueError(f"double free of block {block_id}")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free_block_ids.append(block_id)

    def ref_count(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks})")
        return self._ref_counts[block_id]
