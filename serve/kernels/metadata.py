"""The per-step attention contract between the model runner and the attention kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's queries sit in the flat token stream and where its K/V live.

    The batch is ordered decodes first: sequences `[0, num_decode_seqs)` contribute exactly
    one query token each, so they can run as one batched gather; the rest are prefill or
    extend chunks whose earlier context may already be in the cache.

    Sequence b's new tokens are `query[query_start_loc[b] : query_start_loc[b + 1]]`, at
    absolute positions `[seq_lens[b] - query_len_b, seq_lens[b])`; its K/V for positions
    `[0, seq_lens[b])` live at `block_tables[b][pos // block_size] * block_size + pos % block_size`
    once this step's tokens are written.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot per new token; -1 = skip
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int64, context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    # Host copies, so kernels that loop over sequences never synchronise with the device.
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    num_decode_seqs: int
    # The rows of the model's output the step reads (its sampled tokens'), where the model
    # runner lets the model return those alone: a model may then run its last layer past
    # attention for them only (native_layer_stack.py). None: every row.
    output_rows: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)
