"""One step's input tensors, built from the SchedulerOutput and the sequence mirror."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from serve.kernels import AttentionMetadata
from serve.step import ScheduledSequence, SchedulerOutput
from serve.worker.sequence_mirror import MirroredSequence, SequenceMirror


@dataclass
class PromptSpan:
    """Prompt positions [start, start + count) of a sequence that asked for prompt
    logprobs; their logits (each predicting the next prompt token) are rows
    [offset, offset + count) of the step's prompt logits."""

    seq: MirroredSequence
    start: int
    count: int
    offset: int


@dataclass
class PoolSpan:
    """Prompt positions [start, start + count) of a pooling sequence, computed this step:
    rows [offset, offset + count) of the step's hidden states."""

    seq: MirroredSequence
    start: int
    count: int
    offset: int


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    # The last token of each sampled sequence, then one row per proposal it checks:
    # sampled_seqs[i] has 1 + len(draft_token_ids[i]) consecutive rows of the logits.
    logits_indices: torch.Tensor
    sampled_seqs: list[MirroredSequence]
    draft_token_ids: list[list[int]]  # per sampled sequence: its proposals (speculation)
    prompt_logits_indices: torch.Tensor | None = None  # rows for prompt logprobs
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    pool_spans: list[PoolSpan] = field(default_factory=list)  # pooling sequences' rows

    @property
    def first_logits_rows(self) -> list[int]:
        """Each sampled sequence's first row of the logits (its last known token's)."""
        rows, row = [], 0
        for seq_drafts in self.draft_token_ids:
            rows.append(row)
            row += 1 + len(seq_drafts)
        return rows


def _long_tensor(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


@dataclass(frozen=True)
class QuerySpan:
    """One sequence's query in a paged forward: positions [start, start + count), whose
    K/V go to the slots of `block_table` (which covers them)."""

    block_table: list[int]
    start: int
    count: int


def paged_attention_inputs(
    spans: list[QuerySpan], block_size: int, num_decode_seqs: int, device: torch.device
) -> tuple[torch.Tensor, AttentionMetadata]:
    """The positions ([num_tokens]) and attention metadata of queries laid end to end in
    `spans`' order; the first `num_decode_seqs` spans are single-token decodes."""
    positions: list[int] = []
    slots: list[int] = []
    for span in spans:
        table, positions_of = span.block_table, range(span.start, span.start + span.count)
        positions.extend(positions_of)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in positions_of)
    seq_lens = [span.start + span.count for span in spans]
    query_lens = [span.count for span in spans]
    max_blocks = max(len(span.block_table) for span in spans)
    tables = [span.block_table + [0] * (max_blocks - len(span.block_table)) for span in spans]
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=_long_tensor(slots, device),
        block_tables=_long_tensor(tables, device),
        seq_lens=_long_tensor(seq_lens, device),
        query_start_loc=_long_tensor(query_start_loc, device),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
        num_decode_seqs=num_decode_seqs,
    )
    return _long_tensor(positions, device), meta


def build_model_inputs(
    out: SchedulerOutput,
    mirror: SequenceMirror,
    block_size: int,
    device: torch.device,
    drafts: dict[int, list[int]] | None = None,
) -> ModelInputs:
    """The flat token stream of the step's sequences, decodes first (so attention can
    batch them in one gather), with their positions, cache slots and block tables.
    `drafts` (seq id -> proposals) follow their sequence's last token, in the room the
    scheduler made for them (`num_spec_tokens`): a query of 1 + proposals tokens."""
    drafts = drafts or {}

    def num_tokens(s: ScheduledSequence) -> int:  # what the step computes of it
        return s.num_new_tokens - s.num_spec_tokens + len(drafts.get(s.seq_id, ()))

    ordered = sorted(out.scheduled, key=lambda s: num_tokens(s) != 1)  # stable
    num_decode_seqs = sum(1 for s in ordered if num_tokens(s) == 1)
    token_ids: list[int] = []
    spans: list[QuerySpan] = []
    logits_indices: list[int] = []
    sampled: list[MirroredSequence] = []
    sampled_drafts: list[list[int]] = []
    prompt_indices: list[int] = []
    prompt_spans: list[PromptSpan] = []
    pool_spans: list[PoolSpan] = []
    for s in ordered:
        seq, start = mirror[s.seq_id], s.start
        n_known = s.num_new_tokens - s.num_spec_tokens
        new_tokens = seq.token_ids_between(start, start + n_known)
        if len(new_tokens) != n_known:
            raise RuntimeError(
                f"sequence {s.seq_id}: the step computes positions [{start}, "
                f"{start + n_known}), but the worker knows {seq.num_tokens} of its tokens"
            )
        seq_drafts = drafts.get(s.seq_id, [])
        n = n_known + len(seq_drafts)
        offset = len(token_ids)  # the sequence's first row of the token stream
        token_ids += new_tokens + seq_drafts
        if seq.sampling_params.prompt_logprobs is not None:
            # Position p's logits predict prompt token p + 1; the last prompt position
            # predicts the first output token, which the sampler reports.
            count = min(start + n, seq.num_prompt_tokens - 1) - start
            if count > 0:
                prompt_spans.append(PromptSpan(seq, start, count, len(prompt_indices)))
                prompt_indices.extend(range(offset, offset + count))
        if seq.sampling_params.pooling is not None:
            pool_spans.append(PoolSpan(seq, start, n, offset))
        spans.append(QuerySpan(seq.block_table, start, n))
        if s.is_sampled:
            last = len(token_ids) - 1 - len(seq_drafts)  # the sequence's last known token
            logits_indices.extend(range(last, len(token_ids)))
            sampled.append(seq)
            sampled_drafts.append(seq_drafts)
    positions, meta = paged_attention_inputs(spans, block_size, num_decode_seqs, device)
    return ModelInputs(
        _long_tensor(token_ids, device),
        positions,
        meta,
        _long_tensor(logits_indices, device),
        sampled,
        sampled_drafts,
        _long_tensor(prompt_indices, device) if prompt_indices else None,
        prompt_spans,
        pool_spans,
    )
