"""Builders and tolerances shared by the Triton kernel tests (tests/kernels/test_triton_*.py).

The paged-batch helpers come from the reference kernels' tests, so both suites exercise the
same layouts: shuffled (non-contiguous) block tables, contexts ending mid-block, stale data
in every unwritten slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kernels.test_reference import context_slots, make_paged_batch, random_cache

from serve.kernels import reference
from serve.kernels.metadata import AttentionMetadata

# Relative error bound per dtype: max |out - expected| / max |expected|.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (num_heads, num_kv_heads) of the supported models' attention, plus plain MHA.
GQA_LAYOUTS = {
    "mha": (4, 4),
    "gqa3-smollm2": (9, 3),
    "gqa4": (8, 2),
    "gqa7-qwen2": (14, 2),
    "mqa": (8, 1),
}


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    """NaN (an unwritten, poisoned element) compares as infinitely wrong. Either side may be
    on the GPU (a kernel's output against a CPU reference): both are compared on the CPU."""
    assert out.shape == expected.shape, (out.shape, expected.shape)
    out, expected = out.detach().cpu().double(), expected.detach().cpu().double()
    diff = (out - expected).abs().nan_to_num(nan=float("inf"))
    return (diff.max() / expected.abs().max().clamp_min(1e-30)).item()


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping.to(device),
        block_tables=meta.block_tables.to(device),
        seq_lens=meta.seq_lens.to(device),
        query_start_loc=meta.query_start_loc.to(device),
        seq_lens_cpu=meta.seq_lens_cpu,
        query_lens_cpu=meta.query_lens_cpu,
        num_decode_seqs=meta.num_decode_seqs,
    )


@dataclass
class AttentionInputs:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    meta: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence, its whole context [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    block_tables: list[list[int]]  # unpadded


def make_attention_inputs(
    seq_query_lens: list[tuple[int, int]],
    num_decode_seqs: int,
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    gen: torch.Generator,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    layout: str = "heads_first",
    stale: str = "random",  # what unwritten cache slots hold: "random" or "nan"
) -> AttentionInputs:
    """A batch whose contexts are fully written to a paged cache, as after reshape_and_cache."""
    num_heads, num_kv_heads = heads
    seq_lens, query_lens = map(list, zip(*seq_query_lens))
    batch = make_paged_batch(seq_lens, query_lens, num_decode_seqs, block_size, gen)
    shape = (batch.num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = random_cache(shape, layout, gen), random_cache(shape, layout, gen)
    if stale == "nan":
        key_cache.fill_(float("nan"))
        value_cache.fill_(float("nan"))
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype) for s in seq_lens]
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    for table, k, v, s in zip(batch.block_tables, keys, values, seq_lens):
        slots = context_slots(table, block_size, range(s))
        reference.reshape_and_cache(k, v, key_cache, value_cache, slots)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    device = torch.device(device)
    return AttentionInputs(
        query=query.to(device),
        key_cache=key_cache.to(device),  # .to keeps the heads-first strides
        value_cache=value_cache.to(device),
        meta=to_device(batch.meta, device),
        keys=keys,
        values=values,
        block_tables=batch.block_tables,
    )


@dataclass
class MoeInputs:
    hidden: torch.Tensor  # [num_tokens, hidden]
    w13: torch.Tensor  # [num_experts, 2 * inter, hidden]
    w2: torch.Tensor  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor  # [num_tokens, top_k] int64


def make_moe_inputs(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    gen: torch.Generator,
    *,
    unrouted: tuple[int, ...] = (),  # experts no token is routed to; their weights are NaN
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> MoeInputs:
    """Random tokens routed as the models route them (softmax, top-k, renormalised), with
    the `unrouted` experts' logits at -inf. Their weights are NaN, so an expert without
    tokens that is read anyway poisons the output. Drawn on `gen`'s device."""
    on = gen.device
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=on)
    logits[:, list(unrouted)] = -torch.inf
    topk_weights, topk_ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    topk_weights /= topk_weights.sum(dim=-1, keepdim=True)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=on) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device=on) * inter**-0.5
    w13[list(unrouted)] = float("nan")
    w2[list(unrouted)] = float("nan")
    x = torch.randn(num_tokens, hidden, generator=gen, device=on)
    return MoeInputs(
        hidden=x.to(device, dtype),
        w13=w13.to(device, dtype),
        w2=w2.to(device, dtype),
        topk_weights=topk_weights.to(device),
        topk_ids=topk_ids.to(device),
    )


def naive_moe(inputs: MoeInputs) -> torch.Tensor:
    """The oracle, one token and one of its experts at a time, in float64."""
    x, w13, w2 = inputs.hidden.double(), inputs.w13.double(), inputs.w2.double()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, expert in zip(inputs.topk_weights[t].tolist(), inputs.topk_ids[t].tolist()):
            gate_up = w13[expert] @ x[t]
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += weight * (w2[expert] @ act)
    return out
