"""LoRA slots on a fused linear layer, against the plain formula on fresh random inputs:
each token gets x W^T + (x A_i^T) B_i^T with its own adapter i (none: x W^T), per shard of
q/k/v, with shards an adapter leaves alone unchanged."""

from __future__ import annotations

import torch

from serve.models.layers.linear import QKVParallelLinear
from serve.models.layers.lora import LoRABatch, LoRASlots, lora_batch

HIDDEN, HEAD_DIM, HEADS, KV_HEADS, MAX_RANK = 32, 8, 4, 2, 8


def _layer() -> QKVParallelLinear:
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS)
    layer.weight.data.normal_()
    layer.lora = LoRASlots(
        layer.lora_shards(), HIDDEN, 3, MAX_RANK, torch.float32, torch.device("cpu")
    )
    return layer


def test_each_token_gets_its_adapters_update():
    torch.manual_seed(0)
    layer = _layer()
    rows = {"q": HEADS * HEAD_DIM, "k": KV_HEADS * HEAD_DIM, "v": KV_HEADS * HEAD_DIM}
    adapters = {  # slot -> {shard: (A, B)}; slot 1 leaves k alone, ranks differ
        0: {s: (torch.randn(4, HIDDEN), torch.randn(n, 4)) for s, n in rows.items()},
        1: {s: (torch.randn(8, HIDDEN), torch.randn(rows[s], 8)) for s in ("q", "v")},
    }
    for slot, shards in adapters.items():
        for shard, (a, b) in shards.items():
            a_local, b_local = layer.lora_slices(shard, a, b)
            layer.lora.write(slot, layer.lora.shard_index(shard), a_local, b_local)
    x = torch.randn(7, HIDDEN)
    slot_of_token = [0, None, 1, 1, 0, None, 1]
    groups = [
        (slot, torch.tensor([i for i, s in enumerate(slot_of_token) if s == slot]))
        for slot in (0, 1)
    ]
    with lora_batch(LoRABatch(groups)):
        got = layer(x)
    base = x @ layer.weight.t()
    expected = base.clone()
    offsets = {"q": 0, "k": rows["q"], "v": rows["q"] + rows["k"]}
    for i, slot in enumerate(slot_of_token):
        for shard, (a, b) in adapters.get(slot, {}).items():
            cols = slice(offsets[shard], offsets[shard] + rows[shard])
            expected[i, cols] += (x[i] @ a.t()) @ b.t()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    # Slot 1's k columns are the base layer's; no batch: the base layer alone.
    k_cols = slice(offsets["k"], offsets["v"])
    torch.testing.assert_close(got[2, k_cols], base[2, k_cols])
    torch.testing.assert_close(layer(x), base)
    # One adapter for every token (rows None), after the slot is rewritten with another.
    layer.lora.clear(0)
    a, b = torch.randn(2, HIDDEN), torch.randn(rows["v"], 2)
    layer.lora.write(0, layer.lora.shard_index("v"), a, b)
    with lora_batch(LoRABatch([(0, None)])):
        got = layer(x)
    expected = base.clone()
    expected[:, offsets["v"] :] += (x @ a.t()) @ b.t()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
