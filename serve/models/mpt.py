"""MPT (MosaicML) over a flat token stream of the whole batch.

ALiBi with MPT's own slopes, a fused Wqkv laid out [q | k | v] whose output may be clamped
(`clip_qkv`) and whose q and k may each be layer-normed over the whole projection
(`qk_ln`), LayerNorms and linears without biases (`no_bias`), a GELU MLP
`expansion_ratio` wide, a tied LM head.

transformers' MPT reads fewer of the config's fields than MosaicML's own code
(llm-foundry) does: it always uses alibi_bias_max 8, multi-head attention, no biases, a 4x
MLP, no qk_ln and no logit scale. Here every one of them is read as llm-foundry reads it;
with the values transformers assumes (those of every MPT checkpoint published by
MosaicML), the two compute the same model. Models without ALiBi (learned positions) are
refused: transformers does not implement them either.

Tensor parallel: each rank holds its heads (and their slopes) and its slice of the MLP;
`out_proj` and `down_proj` all-reduce. qk_ln normalises over every rank's heads: each rank
gathers the whole q (and k), normalises it and keeps its own heads.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from serve.distributed.parallel_state import get_tp_group
from serve.models.arch_config import UNLIMITED_POSITIONS, ArchConfig
from serve.models.layers.activation import Activation
from serve.models.layers.attention import Attention
from serve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from serve.models.layers.layernorm import LayerNorm
from serve.models.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from serve.models.partition import first_kv_head
from serve.models.weights import FusedRows, WeightSpec


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """MPT's ALiBi slopes, [num_heads] float32, bit for bit as transformers'
    `build_mpt_alibi_tensor` computes them: 1 / 2^(alibi_bias_max * i / n) for i = 1..n, n
    the power of two at or above num_heads; with fewer heads than n, the odd-indexed slopes
    first, then the even-indexed ones. With alibi_bias_max 8 these are BLOOM's numbers in
    BLOOM's order, but rounded differently past 10 heads (BLOOM raises a rounded base to
    integer powers), and only MPT's follow alibi_bias_max."""
    n = 2 ** math.ceil(math.log2(num_heads))
    exponents = torch.arange(1, n + 1, dtype=torch.int64).float() * (alibi_bias_max / n)
    slopes = 1.0 / torch.pow(2, exponents)
    if n != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


class GatheredLayerNorm(LayerNorm):
    """A LayerNorm over features that are split over the ranks (qk_ln over all heads).

    Each rank holds `num_local` consecutive features starting at `start` of the
    `num_features`; with replicated K/V heads, `num_replicas` consecutive ranks hold the
    same ones. The rank gathers all features, normalises them as one LayerNorm would, and
    keeps its own: the same numbers as at one rank.
    """

    def __init__(
        self,
        num_features: int,
        start: int,
        num_local: int,
        num_replicas: int,
        eps: float,
        bias: bool,
    ) -> None:
        super().__init__(num_features, eps, bias)
        self.start, self.num_local, self.num_replicas = start, num_local, num_replicas
        self.tp = get_tp_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, num_local] -> [T, num_local]
        if self.num_local == self.weight.shape[0]:
            return super().forward(x)
        parts = self.tp.all_gather(x).view(x.shape[0], self.tp.world_size, self.num_local)
        full = parts[:, :: self.num_replicas].flatten(1)  # [T, num_features], rank order
        return super().forward(full)[:, self.start : self.start + self.num_local]


class MptAttention(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf, attn_config = config.hf, config.hf.attn_config
        bias = not hf.no_bias
        self.head_dim = config.head_dim
        self.Wqkv = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads, bias
        )
        self.num_heads, self.num_kv_heads = self.Wqkv.num_heads, self.Wqkv.num_kv_heads
        self.out_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias)
        self.clip_qkv = attn_config.clip_qkv
        self.q_ln = self.k_ln = None
        tp = get_tp_group()
        if attn_config.qk_ln:
            eps, hd = hf.layer_norm_epsilon, self.head_dim
            q_start = tp.rank * self.num_heads * hd
            self.q_ln = GatheredLayerNorm(
                config.num_heads * hd, q_start, self.num_heads * hd, 1, eps, bias
            )
            kv_start = first_kv_head(config.num_kv_heads, tp.world_size, tp.rank) * hd
            kv_replicas = max(1, tp.world_size // config.num_kv_heads)
            self.k_ln = GatheredLayerNorm(
                config.num_kv_heads * hd, kv_start, self.num_kv_heads * hd, kv_replicas, eps, bias
            )
        scale = attn_config.softmax_scale or 1 / math.sqrt(config.hidden_size / config.num_heads)
        first_head = tp.rank * self.num_heads
        slopes = mpt_alibi_slopes(config.num_heads, attn_config.alibi_bias_max)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            scale,
            alibi_slopes=slopes[first_head : first_head + self.num_heads],
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.Wqkv(x)  # [T, (num_heads + 2 * num_kv_heads) * head_dim], this rank's
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = self.Wqkv.split(qkv)
        if self.q_ln is not None and self.k_ln is not None:
            q, k = self.q_ln(q), self.k_ln(k)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        return self.out_proj(self.attn(q, k, v))  # [T, hidden], reduced over ranks


class MptMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias)
        self.act = Activation("gelu")  # exact (erf) GELU
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> [T, inter / tp] -> [T, hidden], reduced
        return self.down_proj(self.act(self.up_proj(x)))


class MptBlock(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        size, eps, bias = config.hidden_size, hf.layer_norm_epsilon, not hf.no_bias
        self.norm_1 = LayerNorm(size, eps, bias)
        self.attn = MptAttention(config)
        self.norm_2 = LayerNorm(size, eps, bias)
        self.ffn = MptMLP(size, config.split_sizes["intermediate_size"], bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        x = self.attn(self.norm_1(x)) + x
        return self.ffn(self.norm_2(x)) + x


class MptModel(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(MptBlock(config) for _ in range(config.num_layers))
        self.norm_f = LayerNorm(config.hidden_size, hf.layer_norm_epsilon, not hf.no_bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids)  # [T, hidden]
        for block in self.blocks:
            x = block(x)
        return self.norm_f(x)


class MptForCausalLM(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        hf = config.hf
        self.transformer = MptModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(hf, "tie_word_embeddings", True):
            self.lm_head.weight = self.transformer.wte.weight
        # llm-foundry multiplies the logits by `logit_scale` ("inv_sqrt_d_model": 1/sqrt(d)).
        logit_scale = hf.logit_scale
        if logit_scale == "inv_sqrt_d_model":
            logit_scale = 1 / math.sqrt(config.hidden_size)
        self.logit_scale = None if logit_scale is None else float(logit_scale)
        # Wqkv's rows are [q heads | k heads | v heads].
        parts = (("q", config.num_heads), ("k", config.num_kv_heads), ("v", config.num_kv_heads))
        self.weight_spec = WeightSpec(fused={"Wqkv": FusedRows(parts, 1, config.head_dim)})

    @classmethod
    def arch_config(cls, hf: Any, architecture: str) -> ArchConfig:
        attn_config = hf.attn_config
        if not attn_config.alibi:
            raise ValueError("MPT without ALiBi (learned positions) is not supported.")
        if hf.norm_type.lower() not in ("layernorm", "low_precision_layernorm"):
            raise ValueError(f"MPT norm_type {hf.norm_type!r} is not supported (LayerNorm only).")
        num_heads = int(hf.n_heads)
        if attn_config.attn_type == "multiquery_attention":
            num_kv_heads = 1
        elif attn_config.attn_type == "grouped_query_attention":  # llm-foundry's configs
            num_kv_heads = int(attn_config.kv_n_heads)
        else:
            num_kv_heads = num_heads
        # max_seq_len is the length trained on: ALiBi's biases go on past it (MosaicML
        # raise it in the config to serve longer contexts), so it limits nothing here.
        return ArchConfig.from_hf(
            hf,
            architecture,
            num_kv_heads=num_kv_heads,
            head_dim=int(hf.d_model) // num_heads,
            max_position=UNLIMITED_POSITIONS,
            split_sizes={"intermediate_size": int(hf.expansion_ratio * hf.d_model)},
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Positions are unused: ALiBi biases the scores by the distance, in the kernel.
        return self.transformer(input_ids)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] on rank 0, None on the other ranks (a collective)."""
        logits = self.lm_head(hidden)
        if logits is None or self.logit_scale is None:
            return logits
        return logits * self.logit_scale
