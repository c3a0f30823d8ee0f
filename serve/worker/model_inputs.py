"""One step's input tensors, built from the SchedulerOutput and the sequence mirror."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from serve.kernels import AttentionMetadata
from serve.lora_request import LoRARequest
from serve.multimodal_inputs import MultiModalInput
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


class ImageSpan(NamedTuple):
    """Part of an image's run of placeholder tokens computed this step: its embeddings
    [first, first + count) go to rows [row, row + count) of the token stream."""

    item: MultiModalInput
    first: int
    count: int
    row: int


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
    # Each sequence's adapter, in token-stream order (`meta.query_lens_cpu`'s).
    loras: list[LoRARequest | None] = field(default_factory=list)
    # The images whose placeholder tokens this step computes (prompt chunks reaching them).
    image_spans: list[ImageSpan] = field(default_factory=list)
    # Each sequence with images: (its images, first position, tokens, first row), for
    # positions that depend on them (Qwen2-VL's M-RoPE).
    mm_rows: list[tuple[tuple[MultiModalInput, ...], int, int, int]] = field(default_factory=list)

    @property
    def first_logits_rows(self) -> list[int]:
        """Each sampled sequence's first row of the logits (its last known token's)."""
        rows, row = [], 0
        for seq_drafts in self.draft_token_ids:
            rows.append(row)
            row += 1 + len(seq_drafts)
        return rows


# Each array's place in the packed buffer starts on a 16-byte boundary, as a separate
# allocation's would: Triton specializes a kernel on its pointers' alignment.
_ALIGN_ELEMENTS = 2


def upload_int64(
    arrays: Sequence[Sequence[int] | np.ndarray], device: torch.device
) -> list[torch.Tensor]:
    """The arrays as int64 tensors on `device`, each in its own shape. On CPU they are the
    arrays' own memory. On a GPU they go up as one asynchronous copy from pinned memory,
    not one copy each from pageable memory (each of those is staged by the driver and
    waits for the stream: the GPU profile showed ~60 us of host time apiece)."""
    host = [np.asarray(a, dtype=np.int64) for a in arrays]  # from a list, ~3x torch.tensor
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in host]
    staging, places = pack_int64(host, pin=device.type == "cuda")
    # The caching host allocator keeps `staging` from reuse until the copy has run.
    uploaded = staging.to(device, non_blocking=True)
    return [uploaded[start:end].view(shape) for start, end, shape in places]


def pack_int64(
    arrays: list[np.ndarray], pin: bool
) -> tuple[torch.Tensor, list[tuple[int, int, tuple[int, ...]]]]:
    """The int64 arrays laid end to end in one host tensor (page-locked with `pin`), each
    from a 16-byte boundary, and each one's place: (start, end, shape)."""
    places, total = [], 0
    for a in arrays:
        places.append((total, total + a.size, a.shape))
        total += -(-a.size // _ALIGN_ELEMENTS) * _ALIGN_ELEMENTS
    staging = torch.empty(max(total, 1), dtype=torch.int64, pin_memory=pin)
    flat = staging.numpy()
    for a, (start, end, _) in zip(arrays, places):
        flat[start:end] = a.reshape(-1)
    return staging, places


class QuerySpan(NamedTuple):
    """One sequence's query in a paged forward: positions [start, start + count), whose
    K/V go to the slots of `block_table` (which covers them). (A tuple: a step makes one
    per sequence, and a frozen dataclass costs ~3x as much to make.)"""

    block_table: Sequence[int]  # the mirror's array('q'), or any sequence of block ids
    start: int
    count: int


def paged_attention_inputs(
    spans: list[QuerySpan], block_size: int, num_decode_seqs: int, device: torch.device
) -> tuple[torch.Tensor, AttentionMetadata]:
    """The positions ([num_tokens]) and attention metadata of queries laid end to end in
    `spans`' order; the first `num_decode_seqs` spans are single-token decodes.

    A per-step hot path: one Python pass over the spans (their block tables copied row by
    row into one array, a memcpy each from the mirror's arrays), the per-token positions and
    slots computed in numpy."""
    positions, meta, _ = _paged_attention(spans, block_size, num_decode_seqs, device, [])
    return positions, meta


def _paged_attention(
    spans: list[QuerySpan],
    block_size: int,
    num_decode_seqs: int,
    device: torch.device,
    also: list[Sequence[int] | np.ndarray],
) -> tuple[torch.Tensor, AttentionMetadata, list[torch.Tensor]]:
    """`paged_attention_inputs`, and the int64 arrays `also` on `device` in the same
    upload (on a GPU, one copy a step)."""
    num_seqs = len(spans)
    starts = np.fromiter((span.start for span in spans), np.int64, num_seqs)
    query_lens = np.fromiter((span.count for span in spans), np.int64, num_seqs)
    max_blocks = max(len(span.block_table) for span in spans)
    tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
    for row, span in zip(tables, spans):
        row[: len(span.block_table)] = span.block_table
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    if num_tokens == num_seqs:  # one token each: decodes (and one-token chunks)
        seq_of_token, positions = np.arange(num_seqs), starts
    else:
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        first_token = np.repeat(query_start_loc[:-1], query_lens)
        positions = np.repeat(starts, query_lens) + (np.arange(num_tokens) - first_token)
    blocks = tables[seq_of_token, positions // block_size]
    slots = blocks * block_size + positions % block_size
    seq_lens = starts + query_lens
    slot_mapping, block_tables, seq_lens_t, query_start, positions_t, *also_t = upload_int64(
        [slots, tables, seq_lens, query_start_loc, positions, *also], device
    )
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens_t,
        query_start_loc=query_start,
        seq_lens_cpu=seq_lens.tolist(),
        query_lens_cpu=query_lens.tolist(),
        num_decode_seqs=num_decode_seqs,
    )
    return positions_t, meta, also_t


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
    # (tokens the step computes of it, the sequence), decodes first, each group in order.
    sized = [
        (s.num_new_tokens - s.num_spec_tokens + len(drafts.get(s.seq_id, ())), s)
        for s in out.scheduled
    ]
    ordered = [x for x in sized if x[0] == 1]
    num_decode_seqs = len(ordered)
    if num_decode_seqs < len(sized):
        ordered += [x for x in sized if x[0] != 1]
    seqs = mirror.seqs
    token_ids: list[int] = []
    spans: list[QuerySpan] = []
    logits_indices: list[int] = []
    sampled: list[MirroredSequence] = []
    sampled_drafts: list[list[int]] = []
    prompt_indices: list[int] = []
    prompt_spans: list[PromptSpan] = []
    pool_spans: list[PoolSpan] = []
    loras: list[LoRARequest | None] = []
    image_spans: list[ImageSpan] = []
    mm_rows: list[tuple[tuple[MultiModalInput, ...], int, int, int]] = []
    for n, s in ordered:
        seq, start = seqs[s.seq_id], s.start
        n_known = s.num_new_tokens - s.num_spec_tokens
        new_tokens = seq.token_ids_between(start, start + n_known)
        if len(new_tokens) != n_known:
            raise RuntimeError(
                f"sequence {s.seq_id}: the step computes positions [{start}, "
                f"{start + n_known}), but the worker knows {seq.num_tokens} of its tokens"
            )
        offset = len(token_ids)  # the sequence's first row of the token stream
        token_ids += new_tokens
        seq_drafts = drafts.get(s.seq_id, [])
        if seq_drafts:
            token_ids += seq_drafts
        params = seq.sampling_params
        if params.prompt_logprobs is not None:
            # Position p's logits predict prompt token p + 1; the last prompt position
            # predicts the first output token, which the sampler reports.
            count = min(start + n, seq.num_prompt_tokens - 1) - start
            if count > 0:
                prompt_spans.append(PromptSpan(seq, start, count, len(prompt_indices)))
                prompt_indices.extend(range(offset, offset + count))
        if params.pooling is not None:
            pool_spans.append(PoolSpan(seq, start, n, offset))
        spans.append(QuerySpan(seq.block_table, start, n))
        loras.append(seq.lora)
        if seq.mm_inputs:
            mm_rows.append((seq.mm_inputs, start, n, offset))
        if seq.mm_inputs and start < seq.num_prompt_tokens:
            end = start + n_known
            for item in seq.mm_inputs:
                if item.overlaps(start, end):
                    first, last = max(start, item.offset), min(end, item.end)
                    image_spans.append(
                        ImageSpan(item, first - item.offset, last - first, offset + first - start)
                    )
        if s.is_sampled:
            last = offset + n_known - 1  # the sequence's last known token
            logits_indices.extend(range(last, offset + n))
            sampled.append(seq)
            sampled_drafts.append(seq_drafts)
    also = [token_ids, logits_indices] + ([prompt_indices] if prompt_indices else [])
    positions, meta, (input_ids, logits_rows, *prompt_rows) = _paged_attention(
        spans, block_size, num_decode_seqs, device, also
    )
    return ModelInputs(
        input_ids,
        positions,
        meta,
        logits_rows,
        sampled,
        sampled_drafts,
        prompt_rows[0] if prompt_rows else None,
        prompt_spans,
        pool_spans,
        loras,
        image_spans,
        mm_rows,
    )
