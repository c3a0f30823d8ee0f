"""The physical KV blocks of one device: who holds each, and which hold a known prefix.

A block is *held* while its ref count (the number of block tables listing it) is above 0,
and *free* otherwise. A free block may still be *cached*: it keeps the K/V of a known
full block of tokens (its prefix hash), and a new request with that prefix takes it back
instead of recomputing. Fresh allocations evict cached blocks in LRU order: the free list
is ordered by release time, and allocation takes the least recently released block.

A pool that places in runs (the device's, on CPU) keeps each sequence's blocks physically
consecutive where it can, because attention reads a sequence's blocks one after another
and the CPU's prefetchers follow a run but not a scatter: decode attention over 64
sequences of 400 tokens took 48 ms with every table one run, 59 ms with burst-like tables
(prompts in runs, decode blocks interleaved) and 101 ms with scattered ones (the layout a
pool that has cycled once hands out). Such a pool takes *clean* blocks (never used, or
released without a prefix hash) before evicting any cached one, and among them the block
after the caller's previous one when it is clean; a new run starts in the middle of the
longest clean stretch when a held block precedes it (leaving the holder room to grow), at
its start otherwise. Cached blocks are still evicted in LRU order, once no clean ones remain.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class NoFreeBlocksError(RuntimeError):
    """Raised by `BlockPool.allocate` when every block is in use."""


class BlockPool:
    def __init__(self, num_blocks: int, place_in_runs: bool = False) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._ref_counts: list[int] = [0] * num_blocks
        # Blocks [_num_touched, num_blocks) were never allocated: free, and taken first, so a
        # large pool (a CPU swap space of millions of small blocks) costs nothing up front.
        self._num_touched = 0
        # Released blocks, least recently released first (the eviction order). An
        # OrderedDict, not a deque: a prefix-cache hit takes a cached block out of the middle.
        self._free: OrderedDict[int, None] = OrderedDict()
        # Placing in runs: 1 where a block is clean (free, holding no prefix). Every block
        # starts in `_free`, so one can be taken from anywhere.
        self._clean: np.ndarray | None = None
        self._num_clean = 0
        if place_in_runs:
            self._num_touched = num_blocks
            self._free = OrderedDict.fromkeys(range(num_blocks))
            self._clean = np.ones(num_blocks, dtype=np.int8)
            self._num_clean = num_blocks
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        # Free blocks holding a prefix, counted as they change: the stats read it twice a
        # second, and counting walked the free list (~20 ms at 131K blocks).
        self._num_cached = 0
        self.peak_num_used = 0

    @property
    def num_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, cached ones included: all of them can be allocated."""
        return len(self._free) + self.num_blocks - self._num_touched

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a known prefix."""
        return self._num_cached

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """Snapshot of the free blocks, in allocation order (for invariant checks)."""
        return (*range(self._num_touched, self.num_blocks), *self._free)

    def allocate(self, after: int | None = None) -> int:
        """Take a free block; it starts with ref count 1. A pool placing in runs takes a
        clean block (the one after `after`, the caller's previous block, when it is
        clean); otherwise, or when none is clean, the least recently released free block
        (forgetting any prefix it held)."""
        if self._num_clean:
            return self._take_clean(after)
        if self._num_touched < self.num_blocks:
            block_id = self._num_touched
            self._num_touched += 1
            self._ref_counts[block_id] = 1
            self._note_usage()
            return block_id
        if not self._free:
            raise NoFreeBlocksError(f"all {self.num_blocks} KV blocks are in use")
        block_id, _ = self._free.popitem(last=False)
        block_hash = self._hash_of_block.pop(block_id, None)
        if block_hash is not None:
            del self._block_of_hash[block_hash]
            self._num_cached -= 1
        self._ref_counts[block_id] = 1
        self._note_usage()
        return block_id

    def incref(self, block_id: int) -> None:
        """Add a holder to a block: a fork, or a prefix-cache hit (which revives a free one)."""
        if self.ref_count(block_id) == 0:
            if block_id not in self._hash_of_block:
                raise ValueError(f"incref of free, uncached block {block_id}")
            del self._free[block_id]
            self._num_cached -= 1
            self._note_usage()
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one holder; the block joins the free list's tail when none remain."""
        if self.ref_count(block_id) < 1:
            raise ValueError(f"double free of block {block_id}")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free[block_id] = None
            if block_id in self._hash_of_block:
                self._num_cached += 1
            elif self._clean is not None:
                self._clean[block_id] = 1
                self._num_clean += 1

    def _take_clean(self, after: int | None) -> int:
        clean = self._clean
        if after is not None and after + 1 < self.num_blocks and clean[after + 1]:
            block_id = after + 1
        else:
            # The longest stretch of clean blocks [start, end).
            edges = np.diff(clean, prepend=0, append=0)
            starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
            longest = int(np.argmax(ends - starts))
            start, end = int(starts[longest]), int(ends[longest])
            held_before = start > 0 and self._ref_counts[start - 1] > 0
            block_id = start + (end - start) // 2 if held_before else start
        clean[block_id] = 0
        self._num_clean -= 1
        del self._free[block_id]
        self._ref_counts[block_id] = 1
        self._note_usage()
        return block_id

    def ref_count(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks})")
        return self._ref_counts[block_id]

    # -- prefix cache ----------------------------------------------------------------------

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Record that held block `block_id` holds the full block of tokens `block_hash`
        names. A hash already cached keeps its first block; the duplicate stays unnamed."""
        if self.ref_count(block_id) < 1:
            raise ValueError(f"cannot cache free block {block_id}")
        if block_hash in self._block_of_hash or block_id in self._hash_of_block:
            return
        self._hash_of_block[block_id] = block_hash
        self._block_of_hash[block_hash] = block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix (vLLM's `reset_prefix_cache`): cached blocks become plain
        free ones. Only while no block is held, since a held block's prefix is in use;
        False (and nothing changed) otherwise."""
        if self.num_used_blocks:
            return False
        if self._clean is not None:
            for block_id in self._hash_of_block:
                self._clean[block_id] = 1
            self._num_clean += len(self._hash_of_block)
        self._hash_of_block.clear()
        self._block_of_hash.clear()
        self._num_cached = 0
        return True

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of_hash.get(block_hash)

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash_of_block.get(block_id)

    def is_free(self, block_id: int) -> bool:
        return self.ref_count(block_id) == 0

    def held_ref_counts(self) -> dict[int, int]:
        """{block id: ref count} of every held block."""
        return {b: r for b, r in enumerate(self._ref_counts) if r}

    def reset_peak(self) -> None:
        self.peak_num_used = self.num_used_blocks

    def _note_usage(self) -> None:
        self.peak_num_used = max(self.peak_num_used, self.num_used_blocks)

    def check_invariants(self) -> None:
        """Assert the free list, ref counts and prefix map agree with each other."""
        assert all(r >= 0 for r in self._ref_counts), "negative ref count"
        zero_ref = {b for b, r in enumerate(self._ref_counts) if r == 0}
        free = set(self.free_block_ids)
        assert free == zero_ref, f"free blocks {sorted(free)} != ref count 0 {sorted(zero_ref)}"
        for block_id, block_hash in self._hash_of_block.items():
            assert self._block_of_hash.get(block_hash) == block_id, (
                f"block {block_id}'s prefix hash maps to {self._block_of_hash.get(block_hash)}"
            )
        assert len(self._block_of_hash) == len(self._hash_of_block), "prefix maps differ in size"
        cached = sum(1 for b in free if b in self._hash_of_block)
        assert self._num_cached == cached, f"cached count {self._num_cached} != {cached}"
        if self._clean is not None:
            clean = {b for b in free if b not in self._hash_of_block}
            marked = set(np.flatnonzero(self._clean).tolist())
            assert marked == clean, f"clean map {sorted(marked)} != free uncached {sorted(clean)}"
            assert self._num_clean == len(clean), "clean count is off"
