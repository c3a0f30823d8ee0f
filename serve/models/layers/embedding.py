"""The token embedding and the LM head, split over ranks by vocabulary rows.

The vocabulary is padded up to a multiple of 64 (partition.py) and each rank holds one
contiguous range of rows of the padded table; padding rows are zero. The embedding looks
up the ids in its range, zeros the others and all-reduces; the LM head computes its
range's logits (plus its rows of the bias, GPT-J's) and gathers them on rank 0, cutting
the padding off. Learned position tables are small: every rank holds the whole table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from serve import kernels
from serve.distributed.parallel_state import TensorParallelGroup, get_tp_group
from serve.models.layers.linear import check_checkpoint_shape
from serve.models.lazy_tensor import LazyTensor, as_lazy
from serve.models.partition import pad_vocab_size, split_evenly


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary rows one rank holds: ids [start, start + num_rows) of the padded table."""

    vocab_size: int
    padded_vocab_size: int
    start: int
    num_rows: int  # the same on every rank, padding included

    @classmethod
    def for_rank(cls, vocab_size: int, tp: TensorParallelGroup) -> VocabShard:
        padded = pad_vocab_size(vocab_size)
        num_rows = split_evenly(padded, tp.world_size, "the padded vocabulary")
        return cls(vocab_size, padded, tp.rank * num_rows, num_rows)

    @property
    def num_real_rows(self) -> int:
        """Rows below `vocab_size`; the rest are padding (a last rank may hold only padding)."""
        return max(0, min(self.num_rows, self.vocab_size - self.start))


class _VocabRows(nn.Module):
    """This rank's rows of a [vocab, hidden] table, loaded from the unpadded checkpoint."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.shard = VocabShard.for_rank(vocab_size, self.tp)
        self.weight = nn.Parameter(
            torch.empty(self.shard.num_rows, hidden_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: LazyTensor | torch.Tensor, shard_name: str | None = None
    ) -> None:
        """This rank's rows of a [vocab, ...] tensor (the table, or the head's bias)."""
        if shard_name is not None:
            raise ValueError(f"a vocabulary table has no shard {shard_name!r}")
        loaded = as_lazy(loaded)
        what = "weight" if param.dim() == 2 else "bias"
        check_checkpoint_shape(loaded, (self.shard.vocab_size, *param.shape[1:]), what)
        num_real = self.shard.num_real_rows
        if num_real:
            param.data[:num_real].copy_(loaded.narrow(0, self.shard.start, num_real))
        param.data[num_real:].zero_()


class VocabParallelEmbedding(_VocabRows):
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp.world_size == 1:
            return F.embedding(token_ids, self.weight)
        local_ids = token_ids - self.shard.start  # [T]
        is_here = (local_ids >= 0) & (local_ids < self.shard.num_rows)  # [T]
        out = F.embedding(local_ids.masked_fill(~is_here, 0), self.weight)  # [T, hidden]
        out.masked_fill_(~is_here.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)  # every id is on exactly one rank


class ParallelLMHead(_VocabRows):
    """Logits from this rank's vocabulary rows, gathered on rank 0. Tied to the embedding
    by assigning its `weight` (same vocabulary, so the same rows on every rank). A `bias`
    (GPT-J) is split the same way: each rank holds its rows' entries, zero for padding."""

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False) -> None:
        super().__init__(vocab_size, hidden_size)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.shard.num_rows), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # [N, hidden] -> [N, vocab] on rank 0, None on the others (all must call it)
        local = kernels.linear(hidden, self.weight, self.bias)  # [N, num_rows]
        logits = self.tp.gather(local, dim=-1, dst=0)  # [N, padded_vocab] on rank 0
        if logits is None or self.shard.padded_vocab_size == self.shard.vocab_size:
            return logits
        return logits[:, : self.shard.vocab_size].contiguous()  # [N, vocab]


class ReplicatedEmbedding(nn.Module):
    """A whole [num_embeddings, dim] table on every rank: learned position tables (GPT-2,
    OPT), too small to be worth splitting."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        return F.embedding(ids, self.weight)
