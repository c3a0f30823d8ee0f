"""Block tables: each sequence's logical KV blocks mapped onto physical blocks.

`BlockManager` is the only writer of block tables and (through its two `BlockPool`s, the
device's and the CPU swap space's) of ref counts, so `check_invariants` can verify the
whole allocation state in one place. It implements PagedAttention's sharing:

- fork: a child table lists the parent's blocks, whose ref counts go up (`share_prefix`:
  the first of them, for a recomputed sequence catching up after a sibling);
- copy-on-write: a sequence about to write into a block that others hold gets a fresh
  block, and the caller copies the K/V (`allocate_slots` returns the (src, dst) pairs).
  Only a partly filled last block is ever written, so full shared blocks are never copied;
- prefix caching: every full block of computed tokens is named by a chained hash of its
  tokens (`prefix_cache.hash_block`), and a new sequence takes the blocks of its longest
  cached prefix instead of recomputing them;
- swapping: a group's blocks move to the CPU pool and back, sharing preserved.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from serve.kv_cache.block_pool import BlockPool, NoFreeBlocksError
from serve.kv_cache.prefix_cache import hash_block, root_hash
from serve.sequence import Sequence

BlockCopy = tuple[int, int]  # (source block id, destination block id)


@dataclass
class PrefixCacheCounters:
    """Prompt tokens looked up in the prefix cache, and how many of them were found: each
    request's first admission only. A preempted request's return is left out, as in vLLM:
    its output so far would count as prompt, and the blocks it computed itself as hits."""

    queries: int = 0
    hits: int = 0


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        place_in_runs: bool = True,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, place_in_runs)
        self.cpu_pool = BlockPool(num_cpu_blocks)
        # seq_id -> physical block ids, in logical order: device blocks for resident
        # sequences, CPU blocks for swapped-out ones. A sequence is in at most one.
        self.block_tables: dict[int, list[int]] = {}
        self.cpu_block_tables: dict[int, list[int]] = {}
        # seq_id -> chained hashes of its first full blocks (computed lazily, tokens never
        # change), and how many of its table's blocks are registered in the prefix cache.
        self._block_hashes: dict[int, list[bytes]] = {}
        self._num_registered: dict[int, int] = {}
        # seq_id -> tokens its table was sized for (the K/V slots that hold a token).
        self._num_slots_filled: dict[int, int] = {}
        self.prefix_cache = PrefixCacheCounters()

    # -- state -----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of device blocks held by some sequence, in [0, 1]."""
        return self.block_pool.num_used_blocks / self.num_blocks

    def num_required_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _num_new_blocks(self, num_tokens: int, table: list[int]) -> int:
        """Blocks `num_tokens` tokens need beyond those `table` already lists."""
        return max(0, self.num_required_blocks(num_tokens) - len(table))

    def get_block_table(self, seq_id: int) -> list[int]:
        return self.block_tables[seq_id]

    def has_table(self, seq_id: int) -> bool:
        return seq_id in self.block_tables

    def is_swapped_out(self, seq_id: int) -> bool:
        return seq_id in self.cpu_block_tables

    def kv_waste_fraction(self) -> float:
        """Allocated token slots that hold no token, over all allocated slots.

        Only a table's last filled block and those past it can have empty slots, and a
        block is filled alike in every table that holds it (writing into a shared block
        copies it first), so only those are looked at: O(sequences), not O(blocks), for
        the stats twice a second. `check_invariants` compares a walk of every block."""
        num_blocks = self.block_pool.num_used_blocks
        if not num_blocks:
            return 0.0
        bs = self.block_size
        partly_filled: dict[int, int] = {}  # block id -> slots filled, under bs
        for seq_id, table in self.block_tables.items():
            num_filled = self._num_slots_filled[seq_id]
            for i in range(num_filled // bs, len(table)):
                slots = max(0, num_filled - i * bs)
                partly_filled[table[i]] = max(partly_filled.get(table[i], 0), slots)
        return sum(bs - n for n in partly_filled.values()) / (num_blocks * bs)

    # -- prefix cache ----------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """The device blocks holding the longest cached prefix of `seq`'s tokens.

        Never the whole sequence: its last token must still run through the model to give
        the logits of the next one. Changes nothing but the sequence's memoised hashes.
        """
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for block_hash in self._hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block_id = self.block_pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def num_blocks_to_admit(self, admissions: Iterable[tuple[list[int], int]]) -> int:
        """Free blocks used by admitting sequences, each (cached_prefix, num_tokens) starting
        with the cached blocks and grown to `num_tokens`: the new blocks, plus the cached
        blocks that must leave the free list (once, however many sequences share them)."""
        revived: set[int] = set()
        num_new = 0
        for cached_prefix, num_tokens in admissions:
            revived.update(b for b in cached_prefix if self.block_pool.is_free(b))
            num_new += self._num_new_blocks(num_tokens, cached_prefix)
        return len(revived) + num_new

    def take_cached_prefix(
        self, seq: Sequence, cached_prefix: list[int], was_preempted: bool = False
    ) -> int:
        """Start `seq`'s table with the cached blocks; returns the tokens they hold.
        `was_preempted`: it is coming back after a preemption, and the lookup is not
        counted in `prefix_cache`."""
        if self.has_table(seq.seq_id) or self.is_swapped_out(seq.seq_id):
            raise ValueError(f"seq {seq.seq_id} already has blocks")
        for block_id in cached_prefix:
            self.block_pool.incref(block_id)
        self.block_tables[seq.seq_id] = list(cached_prefix)
        self._num_registered[seq.seq_id] = len(cached_prefix)
        num_cached_tokens = len(cached_prefix) * self.block_size
        self._num_slots_filled[seq.seq_id] = num_cached_tokens
        if self.enable_prefix_caching and not was_preempted:
            self.prefix_cache.queries += seq.num_tokens
            self.prefix_cache.hits += num_cached_tokens
        return num_cached_tokens

    def mark_computed(self, seq: Sequence) -> None:
        """Register `seq`'s newly completed full blocks in the prefix cache (after a step)."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[seq.seq_id]
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(seq.seq_id, 0)
        if num_full <= start:
            return
        for i, block_hash in enumerate(self._hashes(seq, num_full)[start:num_full], start):
            self.block_pool.cache(table[i], block_hash)
        self._num_registered[seq.seq_id] = num_full

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes = self._block_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else root_hash(seq.cache_key)
            start, end = i * bs, (i + 1) * bs
            images = [m.identifier for m in seq.mm_inputs if m.overlaps(start, end)]
            hashes.append(hash_block(parent, seq.token_ids_between(start, end), images))
        return hashes

    # -- growth and copy-on-write ------------------------------------------------------------

    def num_blocks_needed(
        self, plan: Iterable[tuple[Sequence, int]], swapped_out: bool = False
    ) -> int:
        """Free device blocks that `allocate_slots(seq, num_tokens)` for each (seq,
        num_tokens) of `plan`, in order, would take: new blocks plus copy-on-write copies.
        With `swapped_out`, for sequences whose blocks are in the CPU pool, as if swapped
        back in first (sharing survives the swap, so the copies are the same)."""
        tables, pool = (
            (self.cpu_block_tables, self.cpu_pool)
            if swapped_out
            else (self.block_tables, self.block_pool)
        )
        total = 0
        writers: Counter[int] | None = None  # made only when a shared block is written
        for seq, num_tokens in plan:
            table = tables.get(seq.seq_id, [])
            total += self._num_new_blocks(num_tokens, table)
            shared = self._shared_block_written(seq, num_tokens, table, pool)
            if shared is not None:
                writers = writers if writers is not None else Counter()
                writers[shared] += 1
        for block_id, num_writers in (writers or {}).items():
            # The last holder to write finds itself the only one and writes in place.
            total += min(num_writers, pool.ref_count(block_id) - 1)
        return total

    def can_allocate(self, plan: Iterable[tuple[Sequence, int]], watermark_blocks: int = 0) -> bool:
        return self.num_blocks_needed(plan) <= self.num_free_blocks - watermark_blocks

    def allocate_slots(self, seq: Sequence, num_tokens: int) -> list[BlockCopy]:
        """Grow `seq`'s table to cover `num_tokens` tokens in total, copying on write the
        shared block it is about to write into. Returns the block copies the cache engine
        must make before the forward pass. All-or-nothing: raises `NoFreeBlocksError` and
        changes nothing when the free blocks do not suffice."""
        table = self.block_tables.setdefault(seq.seq_id, [])
        shared = self._shared_block_written(seq, num_tokens, table, self.block_pool)
        # num_blocks_needed for this one sequence: new blocks, and a copy of a shared one.
        needed = self._num_new_blocks(num_tokens, table) + (shared is not None)
        if needed > self.num_free_blocks:
            if not table:
                del self.block_tables[seq.seq_id]
            raise NoFreeBlocksError(
                f"seq {seq.seq_id} needs {needed} blocks, {self.num_free_blocks} are free"
            )
        copies = []
        if shared is not None:
            index = seq.num_planned_tokens // self.block_size
            fresh = self.block_pool.allocate(after=table[index - 1] if index else None)
            self.block_pool.free(shared)
            table[index] = fresh
            copies.append((shared, fresh))
        for _ in range(self._num_new_blocks(num_tokens, table)):
            table.append(self.block_pool.allocate(after=table[-1] if table else None))
        self._num_slots_filled[seq.seq_id] = max(
            num_tokens, self._num_slots_filled.get(seq.seq_id, 0)
        )
        return copies

    def _shared_block_written(
        self, seq: Sequence, num_tokens: int, table: list[int], pool: BlockPool
    ) -> int | None:
        """The block this allocation writes first, if other tables hold it too."""
        first = seq.num_planned_tokens
        index = first // self.block_size
        if num_tokens <= first or index >= len(table):
            return None
        block_id = table[index]
        return block_id if pool.ref_count(block_id) > 1 else None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give the child a table sharing every block of the parent's."""
        if self.has_table(child.seq_id) or self.is_swapped_out(child.seq_id):
            raise ValueError(f"fork target seq {child.seq_id} already has blocks")
        parent_table = self.block_tables[parent.seq_id]
        for block_id in parent_table:
            self.block_pool.incref(block_id)
        self.block_tables[child.seq_id] = list(parent_table)
        self._num_slots_filled[child.seq_id] = self._num_slots_filled[parent.seq_id]
        self._num_registered[child.seq_id] = self._num_registered.get(parent.seq_id, 0)
        if parent.seq_id in self._block_hashes:
            self._block_hashes[child.seq_id] = list(self._block_hashes[parent.seq_id])

    def share_prefix(self, src: Sequence, dst: Sequence, num_blocks: int) -> None:
        """Make `dst`'s table the first `num_blocks` blocks of `src`'s, as a fork would
        have left them, giving back what `dst` held (nothing, or a shorter prefix): a
        recomputed sequence takes the full blocks it shares with a sibling computed before
        it. The caller guarantees that those blocks hold (or a step already scheduled
        writes) tokens `dst` shares with `src`."""
        table = self.block_tables[src.seq_id][:num_blocks]
        if len(table) < num_blocks:
            raise ValueError(f"seq {src.seq_id} holds fewer than {num_blocks} blocks")
        for block_id in table:  # before the frees: a block both hold never becomes free
            self.block_pool.incref(block_id)
        for block_id in reversed(self.block_tables.get(dst.seq_id, [])):
            self.block_pool.free(block_id)
        self.block_tables[dst.seq_id] = table
        self._num_slots_filled[dst.seq_id] = num_blocks * self.block_size
        self._num_registered[dst.seq_id] = min(self._num_registered.get(src.seq_id, 0), num_blocks)

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Give back the blocks of `seq`'s table past those `num_tokens` tokens fill: the
        room a step made for proposals that were rejected. Returns the blocks kept."""
        table = self.block_tables[seq.seq_id]
        keep = self.num_required_blocks(num_tokens)
        while len(table) > keep:
            self.block_pool.free(table.pop())  # never hashed: no computed token is in it
        self._num_slots_filled[seq.seq_id] = min(self._num_slots_filled[seq.seq_id], num_tokens)
        return keep

    def free(self, seq_id: int) -> None:
        """Release every block of seq_id's table (device or CPU); unknown ids are a no-op."""
        # Reverse order: a sequence's tail blocks, the least likely to be shared by a later
        # prompt, become the first evicted.
        for block_id in reversed(self.block_tables.pop(seq_id, [])):
            self.block_pool.free(block_id)
        for block_id in reversed(self.cpu_block_tables.pop(seq_id, [])):
            self.cpu_pool.free(block_id)
        self._block_hashes.pop(seq_id, None)
        self._num_registered.pop(seq_id, None)
        self._num_slots_filled.pop(seq_id, None)

    # -- swapping ------------------------------------------------------------------------------

    def num_swap_blocks(self, seqs: Iterable[Sequence], swapped_out: bool) -> int:
        """Distinct blocks that swapping `seqs` (out of the device, or back in) would move."""
        tables = self.cpu_block_tables if swapped_out else self.block_tables
        return len({b for seq in seqs for b in tables[seq.seq_id]})

    def swap_out(self, seqs: list[Sequence]) -> list[BlockCopy] | None:
        """Move `seqs`' blocks to the CPU pool, keeping what they share shared. Returns the
        (device, cpu) block copies to make, or None (changing nothing) if the CPU swap
        space is too small."""
        try:
            return self._move(
                seqs, self.block_tables, self.cpu_block_tables, self.block_pool, self.cpu_pool
            )
        except NoFreeBlocksError:  # raised before anything moved
            return None

    def swap_in(self, seqs: list[Sequence]) -> list[BlockCopy]:
        """Move `seqs`' blocks back onto the device; returns the (cpu, device) copies.
        The caller checks `num_swap_blocks(seqs, swapped_out=True)` against free blocks."""
        copies = self._move(
            seqs, self.cpu_block_tables, self.block_tables, self.cpu_pool, self.block_pool
        )
        for seq in seqs:  # the fresh device blocks hold the same prefixes again
            self._num_registered[seq.seq_id] = 0
            self.mark_computed(seq)
        return copies

    @staticmethod
    def _move(
        seqs: list[Sequence],
        src_tables: dict[int, list[int]],
        dst_tables: dict[int, list[int]],
        src_pool: BlockPool,
        dst_pool: BlockPool,
    ) -> list[BlockCopy]:
        needed = len({b for seq in seqs for b in src_tables[seq.seq_id]})
        if needed > dst_pool.num_free_blocks:  # all-or-nothing: checked before any move
            raise NoFreeBlocksError(f"moving {needed} blocks, {dst_pool.num_free_blocks} free")
        mapping: dict[int, int] = {}
        for seq in seqs:
            table = src_tables.pop(seq.seq_id)
            new_table = []
            for block_id in table:
                if block_id in mapping:
                    dst_pool.incref(mapping[block_id])
                else:
                    mapping[block_id] = dst_pool.allocate(
                        after=new_table[-1] if new_table else None
                    )
                new_table.append(mapping[block_id])
            for block_id in reversed(table):
                src_pool.free(block_id)
            dst_tables[seq.seq_id] = new_table
        return list(mapping.items())

    # -- checks ----------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert that ref counts equal the number of tables holding each block, in both
        pools, and that no block is both free and held."""
        both = self.block_tables.keys() & self.cpu_block_tables.keys()
        assert not both, f"sequences {sorted(both)} are both resident and swapped out"
        for pool, tables in (
            (self.block_pool, self.block_tables),
            (self.cpu_pool, self.cpu_block_tables),
        ):
            pool.check_invariants()
            holders = Counter(b for table in tables.values() for b in table)
            unknown = set(holders) - set(range(pool.num_blocks))
            assert not unknown, f"block tables hold out-of-range block ids {sorted(unknown)}"
            held = pool.held_ref_counts()
            for block_id in held.keys() | holders.keys():
                assert held.get(block_id, 0) == holders[block_id], (
                    f"block {block_id}: ref count {held.get(block_id, 0)} != "
                    f"{holders[block_id]} tables holding it"
                )
            assert pool.num_free_blocks + len(holders) == pool.num_blocks, (
                f"{pool.num_free_blocks} free + {len(holders)} held != {pool.num_blocks} blocks"
            )
        walked = self._kv_waste_fraction_walked()
        assert abs(self.kv_waste_fraction() - walked) < 1e-9, (
            f"kv_waste_fraction {self.kv_waste_fraction()} != {walked} from every block"
        )

    def _kv_waste_fraction_walked(self) -> float:
        """kv_waste_fraction from every block of every table, for the check."""
        filled: dict[int, int] = {}
        bs = self.block_size
        for seq_id, table in self.block_tables.items():
            num_filled = self._num_slots_filled[seq_id]
            for i, block_id in enumerate(table):
                slots = min(bs, max(0, num_filled - i * bs))
                filled[block_id] = max(filled.get(block_id, 0), slots)
        if not filled:
            return 0.0
        return 1.0 - sum(filled.values()) / (len(filled) * bs)
