"""A step's attention inputs (serve/worker/model_inputs.py), against the definition written
out token by token: the vectorised build must give every position, slot, length and table
row the plain loop gives."""

from __future__ import annotations

import random
from array import array

import numpy as np
import pytest
import torch

from serve.worker.model_inputs import QuerySpan, pack_int64, paged_attention_inputs, upload_int64

CPU = torch.device("cpu")


def spelled_out(spans: list[QuerySpan], block_size: int) -> dict[str, list]:
    positions, slots = [], []
    for span in spans:
        for p in range(span.start, span.start + span.count):
            positions.append(p)
            slots.append(span.block_table[p // block_size] * block_size + p % block_size)
    width = max(len(span.block_table) for span in spans)
    tables = [list(span.block_table) + [0] * (width - len(span.block_table)) for span in spans]
    query_start = [0]
    for span in spans:
        query_start.append(query_start[-1] + span.count)
    return {
        "positions": positions,
        "slots": slots,
        "tables": tables,
        "seq_lens": [span.start + span.count for span in spans],
        "query_lens": [span.count for span in spans],
        "query_start": query_start,
    }


def random_spans(rng: random.Random, num_decodes: int, num_chunks: int, block_size: int):
    spans = []
    for i in range(num_decodes + num_chunks):
        count = 1 if i < num_decodes else rng.randint(1, 40)
        start = rng.randint(0, 100)
        num_blocks = -(-(start + count) // block_size) + rng.randint(0, 2)  # may run past
        table = rng.sample(range(1000), num_blocks)
        spans.append(QuerySpan(array("q", table) if i % 2 else table, start, count))
    return spans


@pytest.mark.parametrize(
    ("num_decodes", "num_chunks", "block_size"),
    [(1, 0, 16), (7, 0, 4), (0, 3, 16), (5, 4, 1), (3, 1, 8)],
)
def test_inputs_match_the_token_by_token_definition(num_decodes, num_chunks, block_size):
    rng = random.Random(num_decodes * 100 + num_chunks * 10 + block_size)
    spans = random_spans(rng, num_decodes, num_chunks, block_size)
    positions, meta = paged_attention_inputs(spans, block_size, num_decodes, CPU)
    want = spelled_out(spans, block_size)
    assert positions.tolist() == want["positions"]
    assert meta.slot_mapping.tolist() == want["slots"]
    assert meta.block_tables.tolist() == want["tables"]
    assert meta.seq_lens.tolist() == want["seq_lens"] == meta.seq_lens_cpu
    assert meta.query_lens_cpu == want["query_lens"]
    assert meta.query_start_loc.tolist() == want["query_start"]
    assert meta.num_decode_seqs == num_decodes
    for tensor in (positions, meta.slot_mapping, meta.block_tables, meta.seq_lens):
        assert tensor.dtype == torch.int64
    assert all(type(n) is int for n in meta.seq_lens_cpu + meta.query_lens_cpu)


def test_arrays_packed_for_one_upload_keep_their_values_shapes_and_alignment():
    """On a GPU a step's int64 inputs go up as one buffer, sliced back into each array."""
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(-(2**40), 2**40, size=shape)
        for shape in [(5,), (3, 7), (1,), (0,), (4, 0), (2, 3)]
    ]
    staging, places = pack_int64(arrays, pin=False)
    for a, (start, end, shape) in zip(arrays, places):
        assert start % 2 == 0  # 16 bytes: Triton specializes on a pointer's alignment
        assert shape == a.shape
        assert torch.equal(staging[start:end].view(shape), torch.from_numpy(a))
    assert staging.numel() == sum(-(-a.size // 2) * 2 for a in arrays)


def test_cpu_inputs_are_the_arrays_own_memory():
    values = np.arange(6, dtype=np.int64)
    (tensor,) = upload_int64([values], CPU)
    values[0] = 99
    assert tensor[0] == 99
