from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return F.embedding(token_ids, self.weight)
