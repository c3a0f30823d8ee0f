"""One step's input tensors, built from the SchedulerOutput and the sequence mirror."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from serve.kernels import AttentionMetadata
from serve.step import SchedulerOutput
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
    logits_indices: torch.Tensor  # [num_sampled]: the last token of each sampled sequence
    sampled_seqs: list[MirroredSequence]  # row i of the logits is sampled_seqs[i]'s
    prompt_logits_indices: torch.Tensor | None = None  # rows for prompt logprobs
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    pool_spans: list[PoolSpan] = field(default_factory=list)  # pooling sequences' rows


def _long_tensor(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def build_model_inputs(
    out: SchedulerOutput, mirror: SequenceMirror, block_size: int, device: torch.device
) -> ModelInputs:
    """The flat token stream of the step's sequences, decodes first (so attention can
    batch them in one gather), with their positions, cache slots and block tables."""
    ordered = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)  # stable
    num_decode_seqs = sum(1 for s in ordered if s.num_new_tokens == 1)
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_lens: list[int] = []
    tables: list[list[int]] = []
    logits_indices: list[int] = []
    sampled: list[MirroredSequence] = []
    prompt_indices: list[int] = []
    prompt_spans: list[PromptSpan] = []
    pool_spans: list[PoolSpan] = []
    for s in ordered:
        seq, start, n = mirror[s.seq_id], s.start, s.num_new_tokens
        new_tokens = seq.token_ids_between(start, start + n)
        if len(new_tokens) != n:
            raise RuntimeError(
                f"sequence {s.seq_id}: the step computes positions [{start}, {start + n}), "
                f"but the worker knows {seq.num_tokens} of its tokens"
            )
        token_ids += new_tokens
        if seq.sampling_params.prompt_logprobs is not None:
            # Position p's logits predict prompt token p + 1; the last prompt position
            # predicts the first output token, which the sampler reports.
            count = min(start + n, seq.num_prompt_tokens - 1) - start
            if count > 0:
                prompt_spans.append(PromptSpan(seq, start, count, len(prompt_indices)))
                prompt_indices.extend(range(len(positions), len(positions) + count))
        if seq.sampling_params.pooling is not None:
            pool_spans.append(PoolSpan(seq, start, n, len(positions)))
        table = seq.block_table
        span = range(start, start + n)
        positions.extend(span)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
        seq_lens.append(start + n)
        query_lens.append(n)
        tables.append(table)
        if s.is_sampled:
            logits_indices.append(len(token_ids) - 1)
            sampled.append(seq)
    max_blocks = max(len(t) for t in tables)
    tables = [t + [0] * (max_blocks - len(t)) for t in tables]
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
    return ModelInputs(
        _long_tensor(token_ids, device),
        _long_tensor(positions, device),
        meta,
        _long_tensor(logits_indices, device),
        sampled,
        _long_tensor(prompt_indices, device) if prompt_indices else None,
        prompt_spans,
        pool_spans,
    )
