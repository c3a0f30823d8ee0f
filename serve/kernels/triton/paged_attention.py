"""The batch-level attention op: decodes to the decode kernel, prefill/extend chunks to the
prefill kernel, both writing disjoint rows of one output."""

from __future__ import annotations

import torch

from serve.kernels.metadata import AttentionMetadata
from serve.kernels.triton.decode_attention import decode_attention
from serve.kernels.triton.prefill_attention import prefill_attention


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float32
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole cached context, with
    the reference's options (ALiBi, sliding window, soft-cap, attention sinks; see
    `reference.paged_attention`).

    Precondition: this step's K/V are already in the cache (`reshape_and_cache`).
    """
    options = {
        "alibi_slopes": alibi_slopes,
        "sliding_window": sliding_window,
        "logit_softcap": logit_softcap,
        "sinks": sinks,
    }
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_decodes = meta.num_decode_seqs
    if num_decodes:
        # Decodes lead the batch with one token each: query rows [0, num_decodes).
        decode_attention(
            query[:num_decodes],
            key_cache,
            value_cache,
            meta.block_tables[:num_decodes],
            meta.seq_lens[:num_decodes],
            max(meta.seq_lens_cpu[:num_decodes]),
            scale,
            out=out[:num_decodes],
            **options,
        )
    if meta.num_seqs > num_decodes:
        prefill_attention(
            query,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            first_seq=num_decodes,
            max_query_len=max(meta.query_lens_cpu[num_decodes:]),
            scale=scale,
            out=out,
            **options,
        )
    return out
