"""What the workers' mirrors hold of each sequence, so that a step sends only the change.

The workers keep every sequence they have been sent: its tokens (they append the ones
they sample), its block table and its sampling state (step.py). `WorkerSync` is the
scheduler's record of that mirror, and the one writer of it: a sequence's first
scheduling sends it whole (`NewSequence`), later ones send the tail of its block table
that changed; beam search's forks and chosen tokens, which the workers did not make,
and the sequences they may forget, wait here for the next step's message.

A block table the workers hold stays valid up to the first entry the block manager has
replaced since: copy-on-write replaces the block a sequence writes first, a recompute
preemption or a swap replaces them all (`table_changed`).
"""

from __future__ import annotations

from serve.kv_cache.block_manager import BlockManager
from serve.sequence import Sequence, SequenceGroup
from serve.step import NewSequence, ScheduledSequence, SchedulerOutput


class WorkerSync:
    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        # seq_id -> leading entries of its block table the workers hold (a sequence the
        # workers know is here, with 0 when they hold none of its table).
        self._num_table_blocks: dict[int, int] = {}
        self._forked: list[tuple[int, int]] = []
        self._appended: dict[int, list[int]] = {}
        self._finished: list[int] = []

    def knows(self, seq_id: int) -> bool:
        return seq_id in self._num_table_blocks

    def schedule(
        self,
        group: SequenceGroup,
        seq: Sequence,
        start: int,
        num_new_tokens: int,
        is_sampled: bool,
        fork_seq_ids: list[int],
        out: SchedulerOutput,
        num_spec_tokens: int = 0,
    ) -> None:
        """Add `seq`'s share of the step to `out`, with what the workers lack of it."""
        table = self.block_manager.get_block_table(seq.seq_id)
        num_known = self._num_table_blocks.get(seq.seq_id)
        if num_known is None:
            out.new_seqs.append(
                NewSequence(
                    seq.seq_id,
                    seq.request_id,
                    seq.prompt_token_ids,
                    seq.sampling_params,
                    seq.seed,
                    group.grammar,
                    group.lora,
                    seq.mm_inputs,
                )
            )
            num_known = 0
        out.scheduled.append(
            ScheduledSequence(
                seq.seq_id,
                start,
                num_new_tokens,
                num_known,
                table[num_known:],
                is_sampled,
                fork_seq_ids,
                num_spec_tokens,
            )
        )
        self._num_table_blocks[seq.seq_id] = len(table)

    def table_changed(self, seq_id: int, first_changed: int = 0) -> None:
        """`seq_id`'s block table changed from entry `first_changed` on."""
        num_known = self._num_table_blocks.get(seq_id)
        if num_known is not None:
            self._num_table_blocks[seq_id] = min(num_known, first_changed)

    def forked(self, parent_id: int, child_id: int, by_workers: bool) -> None:
        """`child_id` copies `parent_id`: made by the workers as they sampled (best_of),
        or by the scheduler (beam search), which the next step then tells them."""
        self._num_table_blocks[child_id] = self._num_table_blocks[parent_id]
        if not by_workers:
            self._forked.append((parent_id, child_id))

    def appended(self, seq_id: int, token_id: int) -> None:
        """The scheduler gave `seq_id` a token the workers did not sample (beam search)."""
        self._appended.setdefault(seq_id, []).append(token_id)

    def finished(self, seq_id: int) -> None:
        """The workers may forget `seq_id` (after the forks and tokens already recorded)."""
        if self._num_table_blocks.pop(seq_id, None) is not None:
            self._finished.append(seq_id)
        self._appended.pop(seq_id, None)

    def discard_forks(self, seq_ids: list[int]) -> None:
        """Forks the workers may have made for a request that ended before they were
        added: forget them."""
        self._finished += seq_ids

    def flush(self, out: SchedulerOutput) -> None:
        """Move the recorded news into `out`."""
        out.forked_seqs, self._forked = self._forked, []
        out.appended_token_ids = list(self._appended.items())
        self._appended = {}
        out.finished_seq_ids, self._finished = self._finished, []
