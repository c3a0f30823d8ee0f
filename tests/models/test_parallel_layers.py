"""Tensor-parallel layers and sharded loading at TP=2 (two gloo CPU ranks) against one rank.

Functions named `*_on_rank` run in both spawned ranks (`tp2_ranks`, see rank_pool.py);
every rank draws the same random weights and inputs from the same seed, loads the
unsharded tensors through the parallel layer's weight loader, and checks its output
against the unsharded layer's. Whole tiny models are loaded from disk on both ranks and
their logits compared with the same model at one rank, in this process.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from serve.config import ModelConfig
from serve.distributed.parallel_state import TensorParallelGroup, get_tp_group
from serve.kernels import AttentionMetadata
from serve.kv_cache.cache_engine import CacheEngine
from serve.models.arch_config import ArchConfig
from serve.models.forward_context import forward_context
from serve.models.layers.attention import Attention, attention_layers
from serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from serve.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from serve.models.lazy_tensor import SafetensorsTensor
from serve.models.loader import iterate_checkpoint, load_hf_config, load_model
from serve.models.partition import check_tensor_parallel, first_kv_head, num_kv_heads_per_rank

NUM_TOKENS = 5


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)  # never zeros: a missed copy or reduce shows


def _replicated(weight: torch.Tensor, bias: torch.Tensor | None) -> ReplicatedLinear:
    layer = ReplicatedLinear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias)
    return layer


def _rank_slice(x: torch.Tensor, num_parts: int, part: int) -> torch.Tensor:
    return x.chunk(num_parts, dim=-1)[part]


# -- linear layers -----------------------------------------------------------------------


def column_parallel_on_rank(seed: int) -> None:
    tp = get_tp_group()
    torch.manual_seed(seed)
    w, b, x = _randn(48, 32), _randn(48), _randn(NUM_TOKENS, 32)
    layer = ColumnParallelLinear(32, 48, bias=True)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    assert layer.weight.shape == (24, 32)
    expected = _replicated(w, b)(x)  # [T, 48]
    out = layer(x)  # [T, 24]
    torch.testing.assert_close(out, _rank_slice(expected, 2, tp.rank))
    torch.testing.assert_close(tp.all_gather(out), expected)


def merged_column_parallel_on_rank(seed: int) -> None:
    tp = get_tp_group()
    torch.manual_seed(seed)
    gate, up, x = _randn(40, 32), _randn(40, 32), _randn(NUM_TOKENS, 32)
    layer = MergedColumnParallelLinear(32, [40, 40], ["gate", "up"])
    layer.weight.weight_loader(layer.weight, up, "up")  # any order
    layer.weight.weight_loader(layer.weight, gate, "gate")
    out_gate, out_up = layer.split(layer(x))  # [T, 20] each: this rank's columns
    torch.testing.assert_close(tp.all_gather(out_gate), x @ gate.T)
    torch.testing.assert_close(tp.all_gather(out_up), x @ up.T)
    with pytest.raises(ValueError, match=r"up: checkpoint shape \(41, 32\)"):
        layer.weight.weight_loader(layer.weight, _randn(41, 32), "up")
    with pytest.raises(ValueError, match="no shard 'down'"):
        layer.weight.weight_loader(layer.weight, up, "down")


def qkv_parallel_on_rank(seed: int, num_kv_heads: int) -> tuple[int, int]:
    tp = get_tp_group()
    torch.manual_seed(seed)
    num_heads, head_dim, hidden = 4, 8, 32
    wq, wk, wv = (
        _randn(32, hidden),
        _randn(num_kv_heads * 8, hidden),
        _randn(num_kv_heads * 8, hidden),
    )
    bq, bk, bv = _randn(32), _randn(num_kv_heads * 8), _randn(num_kv_heads * 8)
    x = _randn(NUM_TOKENS, hidden)
    layer = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=True)
    for name, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
        layer.weight.weight_loader(layer.weight, w, name)
        layer.bias.weight_loader(layer.bias, b, name)
    q, k, v = layer.split(layer(x))
    torch.testing.assert_close(tp.all_gather(q), x @ wq.T + bq)
    # This rank's KV heads: its half when there are 2, head 0 on both ranks when there is 1.
    kv_head = tp.rank if num_kv_heads == 2 else 0
    rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
    torch.testing.assert_close(k, x @ wk[rows].T + bk[rows])
    torch.testing.assert_close(v, x @ wv[rows].T + bv[rows])
    return layer.num_heads, layer.num_kv_heads


def row_parallel_on_rank(seed: int) -> None:
    tp = get_tp_group()
    torch.manual_seed(seed)
    w, b, x = _randn(24, 32), _randn(24), _randn(NUM_TOKENS, 32)
    layer = RowParallelLinear(32, 24, bias=True)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    assert layer.weight.shape == (24, 16)
    out = layer(_rank_slice(x, 2, tp.rank))  # the input arrives split, as o_proj's does
    torch.testing.assert_close(out, _replicated(w, b)(x))  # bias added once, not twice


def test_column_parallel_linear(tp2_ranks):
    tp2_ranks.run(column_parallel_on_rank, 1)


def test_merged_column_parallel_linear(tp2_ranks):
    tp2_ranks.run(merged_column_parallel_on_rank, 2)


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_qkv_parallel_linear_splits_or_replicates_kv_heads(tp2_ranks, num_kv_heads):
    assert tp2_ranks.run(qkv_parallel_on_rank, 3, num_kv_heads) == [(2, 1)] * 2


def test_row_parallel_linear_adds_bias_once(tp2_ranks):
    tp2_ranks.run(row_parallel_on_rank, 4)


# -- vocabulary --------------------------------------------------------------------------


def vocab_parallel_on_rank(seed: int, vocab_size: int) -> tuple[int, int]:
    """`vocab_size` 100 pads to 128 (rank 1: ids 64..99 + 28 padding rows); 30 pads to 64
    (rank 1 holds only padding)."""
    tp = get_tp_group()
    torch.manual_seed(seed)
    hidden = 16
    table, h = _randn(vocab_size, hidden), _randn(NUM_TOKENS, hidden)
    ids = torch.cat([torch.tensor([0, vocab_size - 1]), torch.randint(vocab_size, (6,))])
    embed, head = VocabParallelEmbedding(vocab_size, hidden), ParallelLMHead(vocab_size, hidden)
    for layer in (embed, head):
        layer.weight.weight_loader(layer.weight, table)
    bias = _randn(vocab_size)
    biased_head = ParallelLMHead(vocab_size, hidden, bias=True)  # GPT-J's
    biased_head.weight.weight_loader(biased_head.weight, table)
    biased_head.bias.weight_loader(biased_head.bias, bias)
    torch.testing.assert_close(embed(ids), F.embedding(ids, table))
    logits, biased_logits = head(h), biased_head(h)
    if tp.is_driver:
        assert logits.shape == (NUM_TOKENS, vocab_size)  # padding cut off
        torch.testing.assert_close(logits, h @ table.T)
        torch.testing.assert_close(biased_logits, h @ table.T + bias)
    else:
        assert logits is None and biased_logits is None
    return embed.shard.start, embed.shard.num_real_rows


@pytest.mark.parametrize(
    "vocab_size, shards", [(100, [(0, 64), (64, 36)]), (30, [(0, 30), (32, 0)])]
)
def test_vocab_parallel_embedding_and_lm_head_with_padding(tp2_ranks, vocab_size, shards):
    assert tp2_ranks.run(vocab_parallel_on_rank, 5, vocab_size) == shards


# -- attention sinks ---------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
def test_attention_sinks_load_this_rank_s_heads(rank):
    """Rank r of 2 holds query heads [4r, 4r + 4) of the checkpoint's 8 sink logits, in
    float32 whatever the checkpoint's dtype; another head count is refused."""
    whole = torch.randn(8).to(torch.bfloat16)
    group = TensorParallelGroup(rank=rank, world_size=2)
    with mock.patch("serve.models.layers.attention.get_tp_group", return_value=group):
        layer = Attention(4, 16, 2, 0.25, sinks=True)
        layer.sinks.weight_loader(layer.sinks, whole)
        assert layer.sinks.dtype == torch.float32
        assert torch.equal(layer.sinks, whole[4 * rank : 4 * rank + 4].float())
        with pytest.raises(ValueError, match="sinks: checkpoint shape"):
            layer.sinks.weight_loader(layer.sinks, whole[:4])
    assert Attention(4, 16, 2, 0.25).sinks is None


# -- whole models ------------------------------------------------------------------------

PROMPT = [5, 17, 200, 33, 481, 2, 99, 140, 7, 300, 64, 11, 256, 500, 1, 42, 77, 310, 12]


def prefill_then_decode_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor | None:
    """Logits of a prefill of all but the last token, then of a decode step of the last,
    through a KV cache of this rank's KV heads: [len(token_ids), vocab] on rank 0."""
    attn = attention_layers(model)
    block_size, num_tokens = 4, len(token_ids)
    num_blocks = -(-num_tokens // block_size)
    cache = CacheEngine(
        len(attn), num_blocks, block_size, attn[0].num_kv_heads, attn[0].head_dim,
        torch.float32, torch.device("cpu"),
    )  # fmt: skip
    for layer, kv_cache in zip(attn, cache.kv_caches):
        layer.kv_cache = kv_cache
    logits = []
    for start, end in ((0, num_tokens - 1), (num_tokens - 1, num_tokens)):
        n = end - start
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end),
            block_tables=torch.arange(num_blocks).unsqueeze(0),
            seq_lens=torch.tensor([end]),
            query_start_loc=torch.tensor([0, n]),
            seq_lens_cpu=[end],
            query_lens_cpu=[n],
            num_decode_seqs=int(n == 1),
        )
        with torch.inference_mode(), forward_context(meta):
            hidden = model(torch.tensor(token_ids[start:end]), torch.arange(start, end))
        with torch.inference_mode():
            logits.append(model.compute_logits(hidden))
    return None if logits[0] is None else torch.cat(logits)


def _load(model_dir: Path) -> torch.nn.Module:
    config = ModelConfig(dtype="float32")
    return load_model(config, model_dir, load_hf_config(model_dir), torch.device("cpu"))


def sharded_model_on_rank(model_dir: Path, token_ids: list[int]) -> dict:
    """Load the model at this rank, counting the checkpoint elements read, and run it."""
    elements_read: Counter[str] = Counter()
    read_whole: set[str] = set()
    narrow, load = SafetensorsTensor.narrow, SafetensorsTensor.load

    def counting_narrow(self, dim, start, length):
        out = narrow(self, dim, start, length)
        elements_read[self.name] += out.numel()
        return out

    def counting_load(self):
        out = load(self)
        elements_read[self.name] += out.numel()
        read_whole.add(self.name)
        return out

    with (
        mock.patch.object(SafetensorsTensor, "narrow", counting_narrow),
        mock.patch.object(SafetensorsTensor, "load", counting_load),
    ):
        model = _load(model_dir)
    hidden_size = model.model.embed_tokens.weight.shape[1]
    is_tied = model.lm_head.weight is model.model.embed_tokens.weight
    tables = [model.model.embed_tokens] + ([] if is_tied else [model.lm_head])
    padding_rows = sum(t.shard.num_rows - t.shard.num_real_rows for t in tables)
    return {
        "logits": prefill_then_decode_logits(model, token_ids),
        "elements_read": sum(elements_read.values()),
        "elements_held": sum(p.numel() for p in model.parameters()) - padding_rows * hidden_size,
        "checkpoint_elements": sum(
            torch.Size(t.shape).numel() for _, t in iterate_checkpoint(model_dir)
        ),
        "read_whole": sorted(read_whole),
        "num_kv_heads": attention_layers(model)[0].num_kv_heads,
    }


MODELS = {
    "llama-2-kv-heads": ("llama", {}),  # tied embeddings
    "llama-1-kv-head": ("llama", {"num_key_value_heads": 1}),
    "qwen2-2-kv-heads": ("qwen2", {}),  # untied, q/k/v biases
    "qwen2-1-kv-head-padded-vocab": ("qwen2", {"num_key_value_heads": 1, "vocab_size": 520}),
}


@pytest.mark.parametrize("model", MODELS)
def test_a_sharded_model_matches_one_rank_and_reads_only_its_slices(
    tp2_ranks, tiny_model_factory, model
):
    arch, overrides = MODELS[model]
    model_dir = tiny_model_factory(arch, **overrides)
    expected = prefill_then_decode_logits(_load(model_dir), PROMPT)  # one rank, this process

    r0, r1 = tp2_ranks.run(sharded_model_on_rank, model_dir, PROMPT)
    assert r1["logits"] is None
    assert r0["logits"].shape == expected.shape == (len(PROMPT), overrides.get("vocab_size", 512))
    torch.testing.assert_close(r0["logits"], expected, atol=1e-4, rtol=1e-4)
    assert r0["num_kv_heads"] == r1["num_kv_heads"] == 1
    for r in (r0, r1):
        # Each rank read exactly what it holds: sharded weights only in slices, never
        # whole (only the replicated norms were), and far less than the checkpoint.
        assert r["elements_read"] == r["elements_held"]
        assert r["read_whole"] and all("norm" in name for name in r["read_whole"])
        assert r["elements_read"] < 0.6 * r["checkpoint_elements"]


# -- the start-up check ------------------------------------------------------------------


def _config(heads: int, kv_heads: int, vocab: int = 512, intermediate: int = 128):
    hf = SimpleNamespace(
        hidden_size=heads * 16,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        intermediate_size=intermediate,
    )
    return ArchConfig.from_hf(hf, "LlamaForCausalLM")


@pytest.mark.parametrize(
    "config, tp_size, message",
    [
        (_config(4, 2), 3, "tensor_parallel_size 3 must divide num_attention_heads 4"),
        (_config(6, 3), 2, "num_key_value_heads 3 must be divisible by tensor_parallel_size 2"),
        (_config(12, 12, vocab=100, intermediate=96), 3, "padded vocabulary 128 .*vocab_size 100"),
        (_config(4, 4, intermediate=90), 4, "must divide intermediate_size 90"),
    ],
)
def test_check_tensor_parallel_names_the_numbers(config, tp_size, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(config, tp_size)


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_check_tensor_parallel_accepts_splits_and_kv_replication(tp_size):
    check_tensor_parallel(_config(8, 2, vocab=49152, intermediate=1536), tp_size)


@pytest.mark.parametrize(
    "num_kv_heads, tp_size, per_rank, first_heads",
    [(8, 2, 4, [0, 4]), (2, 2, 1, [0, 1]), (1, 2, 1, [0, 0]), (2, 4, 1, [0, 0, 1, 1])],
)
def test_kv_heads_split_or_replicate(num_kv_heads, tp_size, per_rank, first_heads):
    assert num_kv_heads_per_rank(num_kv_heads, tp_size) == per_rank
    assert [first_kv_head(num_kv_heads, tp_size, r) for r in range(tp_size)] == first_heads


def test_the_check_imports_no_torch():
    """The engine may check a config before any worker (or torch) starts."""
    import subprocess
    import sys

    probe = "import sys, serve.models.partition; sys.exit('torch' in sys.modules)"
    repo_root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", probe], cwd=repo_root, timeout=60)
    assert result.returncode == 0
