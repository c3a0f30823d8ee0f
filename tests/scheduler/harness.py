"""The scheduler tests' fake worker: builders, one engine step, and the checks after it.

Pure Python (no torch). `run_step` plays the engine: schedule, hand the SchedulerOutput to
a `FakeWorker`, update from the worker's fake output. The fake worker keeps the real
sequence mirror (serve/worker/sequence_mirror.py), so every step also tests the message
protocol: the mirror's tokens and block tables must equal the scheduler's. It makes the
step's block moves and K/V writes in a fake KV cache of token ids, samples the token
`FAKE_TOKEN + seq_id` for each sampled sequence (and each fork it is told to make),
scores beams with pseudo-random candidates, and pools a pooling sequence's prompt into
`fake_pooled(prompt)` when its last prompt token is computed. Every invariant is checked after each step,
the fake KV included: each sequence's blocks must hold exactly its computed tokens. Every
step must also carry the running decodes before other work, and with chunked prefill off
never split a prompt.
"""

from __future__ import annotations

import random
import time
import weakref
from collections.abc import Callable

from serve.config import SchedulerConfig, SpeculativeMethod
from serve.kv_cache.block_manager import BlockManager
from serve.sampling_params import SamplingParams
from serve.scheduler.output_deltas import RequestDelta
from serve.scheduler.scheduler import Scheduler
from serve.sequence import Sequence, SequenceGroup, SequenceStatus
from serve.step import BeamCandidates, ModelRunnerOutput, SchedulerOutput
from serve.worker.sequence_mirror import SequenceMirror

FAKE_TOKEN = 7
PROPOSAL_TOKEN = 500_000  # the fake worker's proposals: PROPOSAL_TOKEN + 100 * i + j
FIRST_SCHEDULER_SEQ_ID = 1_000_000
BEAM_VOCAB = 40  # beams choose among tokens [FAKE_TOKEN, FAKE_TOKEN + BEAM_VOCAB)


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
    seed: int = 0,
    scheduling_policy: str = "fcfs",
    sjf_max_wait_s: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
    speculation: SpeculativeMethod | None = None,
    max_loras: int = 0,
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
        scheduling_policy=scheduling_policy,
        sjf_max_wait_s=sjf_max_wait_s,
    )
    sched = Scheduler(
        config,
        max_num_batched_tokens,
        max_model_len,
        block_manager,
        clock=clock,
        speculation=speculation,
        max_loras=max_loras,
    )
    # Tests number their requests' sequences themselves; the scheduler's own ids (forks)
    # start far above them.
    sched._next_seq_id = FIRST_SCHEDULER_SEQ_ID
    _WORKERS[sched] = FakeWorker(num_blocks, num_cpu_blocks, block_size, seed)
    return sched


def worker_of(sched: Scheduler) -> FakeWorker:
    return _WORKERS[sched]


def prompt_of(seq_id: int, n: int) -> list[int]:
    """A prompt no other request shares: prefix-cache hits only where a test makes them."""
    return [1000 * (seq_id + 1) + i for i in range(n)]


def make_group(
    seq_id: int,
    prompt_token_ids: list[int],
    max_tokens: int | None = 4,
    best_of: int = 1,
    beam_width: int = 0,
    priority: int = 0,
) -> SequenceGroup:
    """A one-sequence request (forked into `best_of` samples, or `beam_width` beams, after
    its prompt); arrival order is `seq_id` order."""
    if beam_width > 1:
        params = SamplingParams(
            n=beam_width, use_beam_search=True, temperature=0.0, max_tokens=max_tokens
        )
    else:
        params = SamplingParams(
            temperature=1.0 if best_of > 1 else 0.0, n=best_of, max_tokens=max_tokens
        )
    seq = Sequence(seq_id, f"r{seq_id}", prompt_token_ids, params, arrival_time=float(seq_id))
    return SequenceGroup(
        seq.request_id, [seq], params, arrival_time=float(seq_id), priority=priority
    )


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


def fake_pooled(prompt_token_ids: list[int]) -> list[float]:
    """The fake worker's pooled vector of a prompt."""
    return [float(len(prompt_token_ids)), float(sum(prompt_token_ids))]


def sample_token(seq_id: int) -> int:
    """Forked siblings sample different tokens, so their K/V differ after the fork."""
    return FAKE_TOKEN + seq_id


# -- the fake worker ------------------------------------------------------------------------------


class FakeWorker:
    """The real sequence mirror, and token ids standing in for K/V in each block slot."""

    def __init__(self, num_blocks: int, num_cpu_blocks: int, block_size: int, seed: int) -> None:
        self.block_size = block_size
        self.mirror = SequenceMirror()
        self.device: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.cpu: list[list[int | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.rng = random.Random(seed)
        self.num_proposals = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.mirror.apply(out)
        return self.run(out)

    def run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """The step after its news is applied: block moves, K/V writes, fake samples."""
        for device_block, cpu_block in out.blocks_to_swap_out:
            self.cpu[cpu_block] = list(self.device[device_block])
        for cpu_block, device_block in out.blocks_to_swap_in:
            self.device[device_block] = list(self.cpu[cpu_block])
        for src, dst in out.blocks_to_copy:
            self.device[dst] = list(self.device[src])
        bs = self.block_size
        result = ModelRunnerOutput()
        for s in out.scheduled:
            seq = self.mirror[s.seq_id]
            num_known = s.num_new_tokens - s.num_spec_tokens
            tokens = seq.token_ids_between(s.start, s.start + num_known)
            assert len(tokens) == num_known, "the worker lacks a token it must compute"
            proposals = self.propose(s.num_spec_tokens)
            tokens += proposals
            for pos, token in zip(range(s.start, s.start + len(tokens)), tokens):
                self.device[seq.block_table[pos // bs]][pos % bs] = token
            pools = seq.sampling_params.pooling is not None
            if pools and s.start + s.num_new_tokens == seq.num_prompt_tokens:
                result.pooled[s.seq_id] = fake_pooled(seq.prompt_token_ids)
            if not s.is_sampled:
                continue
            if seq.sampling_params.use_beam_search:
                tokens = self.rng.sample(range(FAKE_TOKEN, FAKE_TOKEN + BEAM_VOCAB), 8)
                logprobs = sorted((-self.rng.random() * 5 for _ in tokens), reverse=True)
                result.beam_candidates.append(BeamCandidates(s.seq_id, tokens, logprobs))
                continue
            if proposals:  # a random number of them accepted, then one token sampled
                num_accepted = self.rng.randint(0, len(proposals))
                result.spec_proposed[s.seq_id] = len(proposals)
                result.spec_accepted[s.seq_id] = num_accepted
                for token in proposals[:num_accepted]:
                    result.seq_ids.append(s.seq_id)
                    result.token_ids.append(token)
                    result.logprobs.append(-0.5)
                    result.top_logprobs.append(None)
                    result.ranks.append(None)
            for seq_id in [s.seq_id, *s.fork_seq_ids]:
                if seq_id != s.seq_id:
                    self.mirror.fork_sample(s.seq_id, seq_id, None)
                result.seq_ids.append(seq_id)
                result.token_ids.append(sample_token(seq_id))
                result.logprobs.append(-1.0)
                result.top_logprobs.append(None)
                result.ranks.append(None)
        self.mirror.append_sampled(result.seq_ids, result.token_ids)
        return result

    def propose(self, room: int) -> list[int]:
        """Speculation: as many proposals as the room, or fewer, even none (distinct
        tokens: a test sees where each went)."""
        if room == 0:
            return []
        self.num_proposals += 1
        return [
            PROPOSAL_TOKEN + self.num_proposals * 100 + i for i in range(self.rng.randint(0, room))
        ]

    def check(self, seq: Sequence, table: list[int], on_cpu: bool) -> None:
        blocks, bs = (self.cpu if on_cpu else self.device), self.block_size
        n = seq.num_computed_tokens
        held = [blocks[table[i // bs]][i % bs] for i in range(n)]
        assert held == seq.token_ids_between(0, n), f"seq {seq.seq_id}'s KV is not its tokens"


_WORKERS: weakref.WeakKeyDictionary[Scheduler, FakeWorker] = weakref.WeakKeyDictionary()


# -- checks --------------------------------------------------------------------------------------


def check_state(sched: Scheduler) -> None:
    """What must hold between steps, beyond the block manager's own invariants."""
    bm, worker = sched.block_manager, _WORKERS[sched]
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
            worker.check(seq, table, on_cpu=status is SequenceStatus.SWAPPED)
    for group in sched.waiting:  # new, or preempted to be recomputed
        assert not group.is_finished
        for seq in group.live_seqs:
            assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
    # fcfs: arrival order, running, then swapped, then waiting. Not quite with swapping:
    # swapped groups come back before the recompute-preempted groups (as in vLLM), which
    # may have arrived earlier. priority: running and swapped in rank order (sjf's ranks
    # move as requests generate).
    if sched.policy.name == "fcfs":
        queues = (sched.running, sched.swapped, sched.waiting)
        if bm.cpu_pool.num_blocks:
            queues = (sched.running, sched.swapped)
        # A request passed over for its adapter (max_loras) lets later ones by.
        arrivals = [g.arrival_time for q in queues for g in q if g.lora is None]
        assert arrivals == sorted(arrivals)
    elif sched.policy.name == "priority":
        for queue in (sched.running, sched.swapped):
            ranks = [sched.policy.rank(g) for g in queue]
            assert ranks == sorted(ranks)


def run_step(sched: Scheduler) -> SchedulerOutput:
    out, _ = run_step_with_deltas(sched)
    return out


def run_step_with_deltas(sched: Scheduler) -> tuple[SchedulerOutput, list[RequestDelta]]:
    bm, worker = sched.block_manager, _WORKERS[sched]
    num_unfinished = sched.num_unfinished
    decoding = [g for g in sched.running if is_decoding(g)]
    out = sched.schedule()
    # Budgets, and progress: with work left, a step always computes something.
    assert out.num_seqs <= sched.max_num_seqs
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    ended = num_unfinished - sched.num_unfinished  # groups too big for the cache, ended
    assert num_unfinished == 0 or not out.is_empty or ended, "a step with work left did nothing"
    scheduled = [sched.get_seq(s.seq_id) for s in out.scheduled]
    assert len({s.seq_id for s in scheduled}) == len(scheduled)
    preempted = [sched.get_group(request_id) for request_id in out.preempted_request_ids]
    preempted_ids = {s.seq_id for g in preempted for s in g.seqs}
    assert not {s.seq_id for s in scheduled} & preempted_ids
    for s, seq in zip(out.scheduled, scheduled):
        assert seq.status is SequenceStatus.RUNNING
        assert 1 <= s.num_new_tokens - s.num_spec_tokens <= seq.num_uncomputed_tokens
        assert s.num_spec_tokens == 0 or (s.is_sampled and not s.fork_seq_ids)
        if not sched.enable_chunked_prefill:
            # Whole or not at all: a prompt, a recompute, or a catch-up (all but the last).
            whole = {seq.num_uncomputed_tokens}
            if _group_of(sched, seq).num_live_seqs > 1:
                whole.add(seq.num_uncomputed_tokens - 1)
            assert s.num_new_tokens in whole, "a prompt was split with chunked prefill off"
        table = bm.get_block_table(seq.seq_id)
        assert len(table) == bm.num_required_blocks(s.start + s.num_new_tokens)
    check_decodes_first(sched, decoding, out, preempted)
    # Copy-on-write copies only a partly filled block, the one a sequence writes first.
    bs = bm.block_size
    tables = {s.seq_id: bm.get_block_table(s.seq_id) for s in out.scheduled}
    first_written = {tables[s.seq_id][s.start // bs]: s.start % bs for s in out.scheduled}
    for _, dst in out.blocks_to_copy:
        assert first_written.get(dst, 0) != 0, f"copy into block {dst} is not copy-on-write"
    assert not (out.blocks_to_swap_in and preempted), "swapped in while preempting"
    for group in preempted:
        for seq in group.live_seqs:
            if seq.status is SequenceStatus.SWAPPED:
                assert group in sched.swapped and bm.is_swapped_out(seq.seq_id)
            else:
                assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
                assert group in sched.waiting

    sampled_ids = {s.seq_id for s in out.scheduled if s.is_sampled}
    for seq in scheduled:  # a group's sequences sample together, or not at all
        if seq.seq_id in sampled_ids:
            group = sched.get_group(seq.request_id)
            assert {s.seq_id for s in group.live_seqs} <= sampled_ids

    worker.mirror.apply(out)
    check_mirror(sched, worker)
    for s in out.scheduled:  # the mirror's tables are the block manager's
        assert list(worker.mirror[s.seq_id].block_table) == tables[s.seq_id]
    result = worker.run(out)
    deltas = sched.update_from_output(out, result)
    for s, seq in zip(out.scheduled, scheduled):
        if seq.is_finished:
            continue
        if s.is_sampled:  # just its new token left to compute
            assert seq.num_uncomputed_tokens == 1
        else:  # a prefill chunk (or a catch-up) stopped short of the last token
            assert seq.num_uncomputed_tokens >= 1
    check_state(sched)
    return out, deltas


def check_mirror(sched: Scheduler, worker: FakeWorker) -> None:
    """With a step's news applied, the workers' mirror holds every sequence they know,
    with the scheduler's tokens and its request's adapter, and none that has ended."""
    known = set()
    for group in [*sched.running, *sched.swapped, *sched.waiting]:
        for seq in group.live_seqs:
            if sched.worker_sync.knows(seq.seq_id):
                known.add(seq.seq_id)
                mirrored = worker.mirror[seq.seq_id]
                assert mirrored.output_token_ids == seq.output_token_ids
                assert mirrored.prompt_token_ids == seq.prompt_token_ids
                assert mirrored.lora == group.lora
    assert set(worker.mirror.seqs) == known, "the mirror holds ended sequences"


def is_decoding(group: SequenceGroup) -> bool:
    return all(seq.num_uncomputed_tokens == 1 for seq in group.live_seqs)


def check_decodes_first(
    sched: Scheduler,
    decoding: list[SequenceGroup],
    out: SchedulerOutput,
    preempted: list[SequenceGroup],
) -> None:
    """Decodes take the budget first: `decoding` (the running groups that needed one token
    a sequence before the step) are all scheduled, unless preempted or too wide for what
    older decodes left; and the step lists them before any other work."""
    scheduled_ids = {s.seq_id for s in out.scheduled}
    if preempted or any(g.is_finished for g in decoding):
        return  # victims' planned tokens are left unused: the sums below don't hold
    decode_tokens = sum(g.num_live_seqs for g in decoding if g.live_seqs[0].seq_id in scheduled_ids)
    for group in decoding:
        if not {s.seq_id for s in group.live_seqs} <= scheduled_ids:
            assert group.num_live_seqs > sched.max_num_batched_tokens - decode_tokens
    decode_ids = {s.seq_id for g in decoding for s in g.live_seqs}
    kinds = [s.seq_id in decode_ids for s in out.scheduled]
    assert kinds == sorted(kinds, reverse=True), "other work listed before a decode"


def _group_of(sched: Scheduler, seq: Sequence) -> SequenceGroup:
    (group,) = [g for g in sched.running if seq in g.seqs]
    return group


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        outs.append(run_step(sched))
        assert len(outs) < max_steps, "the scheduler stopped making progress"
    return outs


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.cpu_pool.num_free_blocks == bm.cpu_pool.num_blocks
    assert not bm.block_tables and not bm.cpu_block_tables
    assert not sched.running and not sched.waiting and not sched.swapped
    # One more step tells the workers what ended: their mirror is then empty.
    run_step(sched)
    assert len(_WORKERS[sched].mirror) == 0


def scheduled_ids(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(s.seq_id, s.num_new_tokens) for s in out.scheduled]
