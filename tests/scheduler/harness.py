"""The scheduler tests' fake engine: builders, one engine step, and the checks after it.

Pure Python (no torch). `run_step` plays the engine: schedule, apply the step's block
moves and writes to a fake KV cache, note which sequences sample, update, fork groups that sample for the first time into
`best_of` sequences, append a fake token to each sampled sequence, finish the ones that
reached `max_tokens` or the context window, end the groups the scheduler found too big
for the cache; then checks every invariant, the fake KV included: each sequence's blocks
must hold exactly its computed tokens. Every step must also carry the running decodes
before other work, and with chunked prefill off never split a prompt.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

from serve.config import SchedulerConfig
from serve.kv_cache.block_manager import BlockManager
from serve.sampling_params import SamplingParams
from serve.scheduler.output import SchedulerOutput
from serve.scheduler.scheduler import Scheduler
from serve.sequence import Sequence, SequenceGroup, SequenceStatus

FAKE_TOKEN = 7

# Called once per group that sampled in a step, before the tokens are appended, with the
# group's sampled sequences: may fork (beam-like) or finish sequences; returns the
# sequences that take a token.
OnSample = Callable[[Scheduler, SequenceGroup, list[Sequence]], list[Sequence]]


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int | None = None,
    num_cpu_blocks: int = 0,
    preemption_mode: str | None = None,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
) -> Scheduler:
    block_manager = BlockManager(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching)
    # As the engine does: one sequence of max_model_len always fits in the cache, and
    # without chunks it fits one step.
    max_model_len = max_model_len or num_blocks * block_size
    assert max_model_len <= num_blocks * block_size
    assert enable_chunked_prefill or max_num_batched_tokens >= max_model_len
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        preemption_mode=preemption_mode,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    sched = Scheduler(config, max_num_batched_tokens, max_model_len, block_manager)
    _KV[sched] = FakeKV(num_blocks, num_cpu_blocks, block_size)
    return sched


def prompt_of(seq_id: int, n: int) -> list[int]:
    """A prompt no other request shares: prefix-cache hits only where a test makes them."""
    return [1000 * (seq_id + 1) + i for i in range(n)]


def make_group(
    seq_id: int,
    prompt_token_ids: list[int],
    max_tokens: int | None = 4,
    best_of: int = 1,
) -> SequenceGroup:
    """A one-sequence request (forked into `best_of` after its prompt); arrival order is
    `seq_id` order."""
    params = SamplingParams(
        temperature=1.0 if best_of > 1 else 0.0, n=best_of, max_tokens=max_tokens
    )
    seq = Sequence(seq_id, f"r{seq_id}", prompt_token_ids, params, arrival_time=float(seq_id))
    return SequenceGroup(seq.request_id, [seq], params, arrival_time=float(seq_id))


def make_groups(
    prompt_lens: list[int], max_tokens: int | None = 4, first_id: int = 0, best_of: int = 1
) -> list[SequenceGroup]:
    return [
        make_group(seq_id, prompt_of(seq_id, n), max_tokens, best_of)
        for seq_id, n in enumerate(prompt_lens, start=first_id)
    ]


def add_all(sched: Scheduler, groups: list[SequenceGroup]) -> list[SequenceGroup]:
    for group in groups:
        sched.add(group)
    return groups


def sample_token(seq: Sequence) -> int:
    """Forked siblings sample different tokens, so their K/V differ after the fork."""
    return FAKE_TOKEN + seq.seq_id


_CHILD_IDS = itertools.count(1_000_000)  # above every id a test gives a request


def fork(sched: Scheduler, parent: Sequence, group: SequenceGroup) -> Sequence:
    child = parent.fork(next(_CHILD_IDS))
    sched.fork(parent, child, group)
    return child


# -- the fake KV cache ------------------------------------------------------------------------


class FakeKV:
    """Token ids standing in for K/V: what each device and CPU block slot holds."""

    def __init__(self, num_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.cpu = [[None] * block_size for _ in range(num_cpu_blocks)]

    def apply(self, out: SchedulerOutput) -> None:
        """The cache engine's moves, in its order, then the forward pass's writes."""
        for device_block, cpu_block in out.blocks_to_swap_out:
            self.cpu[cpu_block] = list(self.device[device_block])
        for cpu_block, device_block in out.blocks_to_swap_in:
            self.device[device_block] = list(self.cpu[cpu_block])
        for src, dst in out.blocks_to_copy:
            self.device[dst] = list(self.device[src])
        bs = self.block_size
        for s in out.scheduled:
            start = s.start
            for pos in range(start, start + s.num_new_tokens):
                self.device[s.block_table[pos // bs]][pos % bs] = s.seq.token_at(pos)

    def check(self, seq: Sequence, table: list[int], on_cpu: bool) -> None:
        blocks, bs = (self.cpu if on_cpu else self.device), self.block_size
        n = seq.num_computed_tokens
        held = [blocks[table[i // bs]][i % bs] for i in range(n)]
        assert held == seq.token_ids_between(0, n), f"seq {seq.seq_id}'s KV is not its tokens"


_KV: weakref.WeakKeyDictionary[Scheduler, FakeKV] = weakref.WeakKeyDictionary()


# -- checks --------------------------------------------------------------------------------------


def check_state(sched: Scheduler) -> None:
    """What must hold between steps, beyond the block manager's own invariants."""
    bm, kv = sched.block_manager, _KV[sched]
    bm.check_invariants()
    assert sum(g.max_num_seqs for g in sched.running) <= sched.max_num_seqs
    # Only running sequences hold device blocks and only swapped ones CPU blocks, exactly
    # enough for their computed tokens, holding those tokens.
    for groups, status, tables in (
        (sched.running, SequenceStatus.RUNNING, bm.block_tables),
        (sched.swapped, SequenceStatus.SWAPPED, bm.cpu_block_tables),
    ):
        live = [s for g in groups for s in g.live_seqs]
        assert all(not g.is_finished for g in groups)
        assert all(s.status is status for s in live)
        assert set(tables) == {s.seq_id for s in live}
        for seq in live:
            table = tables[seq.seq_id]
            assert len(table) == bm.num_required_blocks(seq.num_computed_tokens)
            kv.check(seq, table, on_cpu=status is SequenceStatus.SWAPPED)
    for group in sched.waiting:  # new, or preempted to be recomputed
        assert not group.is_finished
        for seq in group.live_seqs:
            assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
    # Arrival order: running, then swapped, then waiting. Not quite with swapping: swapped
    # groups come back before the recompute-preempted groups (as in vLLM), which may have
    # arrived earlier.
    queues = (sched.running, sched.swapped, sched.waiting)
    if bm.cpu_pool.num_blocks:
        queues = (sched.running, sched.swapped)
    arrivals = [g.arrival_time for q in queues for g in q]
    assert arrivals == sorted(arrivals)


def run_step(sched: Scheduler, on_sample: OnSample | None = None) -> SchedulerOutput:
    bm = sched.block_manager
    num_unfinished = sched.num_unfinished
    decoding = [g for g in sched.running if is_decoding(g)]
    out = sched.schedule()
    # A group that cannot grow holding the whole cache: the engine ends it at once.
    for group in out.cannot_fit:
        assert group not in sched.running and group not in sched.swapped
        assert group not in sched.waiting
        sched.finish(group)
    # Budgets, and progress: with work left, a step always computes something.
    assert out.num_seqs <= sched.max_num_seqs
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert num_unfinished == 0 or not out.is_empty or out.cannot_fit, (
        "a step with work left did nothing"
    )
    scheduled = [s.seq for s in out.scheduled]
    assert len({s.seq_id for s in scheduled}) == len(scheduled)
    preempted_ids = {s.seq_id for g in out.preempted + out.cannot_fit for s in g.seqs}
    assert not {s.seq_id for s in scheduled} & preempted_ids
    for s in out.scheduled:
        assert s.seq.status is SequenceStatus.RUNNING
        assert 1 <= s.num_new_tokens <= s.seq.num_uncomputed_tokens
        if not sched.enable_chunked_prefill:
            # Whole or not at all: a prompt, a recompute, or a catch-up (all but the last).
            whole = {s.seq.num_uncomputed_tokens}
            if _group_of(sched, s.seq).num_live_seqs > 1:
                whole.add(s.seq.num_uncomputed_tokens - 1)
            assert s.num_new_tokens in whole, "a prompt was split with chunked prefill off"
        assert s.block_table == bm.get_block_table(s.seq.seq_id)
        assert len(s.block_table) == bm.num_required_blocks(s.start + s.num_new_tokens)
    check_decodes_first(sched, decoding, out)
    # Copy-on-write copies only a partly filled block, the one a sequence writes first.
    bs = bm.block_size
    first_written = {s.block_table[s.start // bs]: s.start % bs for s in out.scheduled}
    for _, dst in out.blocks_to_copy:
        assert first_written.get(dst, 0) != 0, f"copy into block {dst} is not copy-on-write"
    assert not (out.blocks_to_swap_in and out.preempted), "swapped in while preempting"
    for group in out.preempted:
        for seq in group.live_seqs:
            if seq.status is SequenceStatus.SWAPPED:
                assert group in sched.swapped and bm.is_swapped_out(seq.seq_id)
            else:
                assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
                assert group in sched.waiting
    _KV[sched].apply(out)
    sampled = [s.seq for s in out.scheduled if s.is_sampled]
    sched.update(out)

    groups: dict[str, list[Sequence]] = {}
    for seq in sampled:
        groups.setdefault(seq.request_id, []).append(seq)
    for seqs in groups.values():
        group = _group_of(sched, seqs[0])
        # A group's sequences sample together, or not at all.
        assert {s.seq_id for s in seqs} == {s.seq_id for s in group.live_seqs}
        if group.needs_fork:
            (parent,) = seqs
            seqs += [fork(sched, parent, group) for _ in range(group.sampling_params.best_of - 1)]
            group.forked = True
        if on_sample is not None:
            seqs = on_sample(sched, group, seqs)
        for seq in seqs:
            seq.append_token(sample_token(seq), 0.0, None)
            max_tokens = seq.sampling_params.max_tokens
            if (
                max_tokens is not None and seq.num_output_tokens >= max_tokens
            ) or seq.num_tokens >= sched.max_model_len:
                sched.finish_seq(seq)
        if group.is_finished:
            sched.finish(group)
    sampled_ids = {seq.seq_id for seq in sampled}
    for s in out.scheduled:
        if s.seq.is_finished:
            continue
        if s.seq.seq_id in sampled_ids:  # just its new token left to compute
            assert s.seq.num_uncomputed_tokens == 1
        else:  # a prefill chunk (or a catch-up) stopped short of the last token
            assert s.seq.num_uncomputed_tokens >= 1
    check_state(sched)
    return out


def is_decoding(group: SequenceGroup) -> bool:
    return all(seq.num_uncomputed_tokens == 1 for seq in group.live_seqs)


def check_decodes_first(
    sched: Scheduler, decoding: list[SequenceGroup], out: SchedulerOutput
) -> None:
    """Decodes take the budget first: `decoding` (the running groups that needed one token
    a sequence before the step) are all scheduled, unless preempted or too wide for what
    older decodes left; and the step lists them before any other work."""
    scheduled_ids = {s.seq.seq_id for s in out.scheduled}
    if out.preempted or out.cannot_fit:
        return  # victims' planned tokens are left unused: the sums below don't hold
    decode_tokens = sum(g.num_live_seqs for g in decoding if g.live_seqs[0].seq_id in scheduled_ids)
    for group in decoding:
        if not {s.seq_id for s in group.live_seqs} <= scheduled_ids:
            assert group.num_live_seqs > sched.max_num_batched_tokens - decode_tokens
    decode_ids = {s.seq_id for g in decoding for s in g.live_seqs}
    kinds = [s.seq.seq_id in decode_ids for s in out.scheduled]
    assert kinds == sorted(kinds, reverse=True), "other work listed before a decode"


def _group_of(sched: Scheduler, seq: Sequence) -> SequenceGroup:
    (group,) = [g for g in sched.running if seq in g.seqs]
    return group


def run_to_completion(
    sched: Scheduler, max_steps: int = 10_000, on_sample: OnSample | None = None
) -> list[SchedulerOutput]:
    outs = []
    while sched.num_unfinished:
        outs.append(run_step(sched, on_sample))
        assert len(outs) < max_steps, "the scheduler stopped making progress"
    return outs


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.cpu_pool.num_free_blocks == bm.cpu_pool.num_blocks
    assert not bm.block_tables and not bm.cpu_block_tables
    assert not sched.running and not sched.waiting and not sched.swapped


def scheduled_ids(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]
