"""Turn a batch of logits into one token per sequence, each with its own controls.

Every control is a batched tensor op over the rows that use it. A token is drawn by
inverse-CDF sampling, one uniform number per row: a seeded request draws its number from
its own generator, so its tokens never depend on its batch. (One number per row, not one
per vocabulary entry as the exponential-race trick needs, keeps the draw cheap on CPU.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each sampled token under the model
    top_logprobs: list[dict[int, float] | None]  # per sequence that asked for `logprobs`


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._seq_generators: dict[int, torch.Generator] = {}

    def _unseeded_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self._seed)
        return self._generators[device]

    def _seq_generator(self, seq: Sequence, device: torch.device) -> torch.Generator:
        gen = self._seq_generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device).manual_seed(seq.seed)
            self._seq_generators[seq.seq_id] = gen
        return gen

    def free(self, seq_id: int) -> None:
        self._seq_generators.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        # logits: [num_seqs, vocab] float32
        params = [s.sampling_params for s in seqs]
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            token_ids[rows] = self._sample(logits[rows], [seqs[i] for i in random_rows])

        # Log-probabilities under the model's own distribution (before temperature and
        # filters), as vLLM reports them; logit - logsumexp avoids a full log_softmax.
        log_normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)  # [num_seqs, 1]
        sampled_logprobs = (logits.gather(1, token_ids[:, None]) - log_normalizer).squeeze(1)
        token_list = token_ids.tolist()
        sampled_list = sampled_logprobs.tolist()
        num_top = max((p.logprobs or 0 for p in params), default=0)
        if num_top:
            top = logits.topk(num_top, dim=-1)
            top_ids, top_values = top.indices.tolist(), (top.values - log_normalizer).tolist()
        top_logprobs: list[dict[int, float] | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                top_logprobs.append(None)
                continue
            entry = (
                dict(zip(top_ids[i][: p.logprobs], top_values[i][: p.logprobs]))
                if p.logprobs
                else {}
            )
            entry[token_list[i]] = sampled_list[i]
            top_logprobs.append(entry)
        return SamplerOutput(token_list, sampled_list, top_logprobs)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.sampling_params for s in seqs]
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temperature[:, None]
        if any(p.top_k for p in params):
            logits = _apply_top_k(logits, [p.top_k for p in params])
        if any(p.top_p < 1.0 for p in params):
            logits = _apply_top_p(logits, torch.tensor([p.top_p for p in params], device=device))
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)

        uniform = torch.empty(len(seqs), device=device)
        unseeded = [i for i, seq in enumerate(seqs) if seq.seed is None]
        if unseeded:
            uniform[unseeded] = torch.rand(
                len(unseeded), device=device, generator=self._unseeded_generator(device)
            )
        for i, seq in enumerate(seqs):
            if seq.seed is not None:
                uniform[i] = torch.rand(
                    1, device=device, generator=self._seq_generator(seq, device)
                )
        cdf = probs.cumsum(dim=-1)  # [num_seqs, vocab]
        # The first token whose cumulative probability exceeds u; zero-probability tokens
        # never qualify, since the CDF does not rise at them.
        target = uniform[:, None] * cdf[:, -1:]
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = logits.shape[1]
    k = torch.tensor([min(k, vocab) if k else vocab for k in top_k], device=logits.device)
    sorted_desc = logits.topk(int(k.max()), dim=-1).values  # [num_seqs, max_k]
    kth = sorted_desc.gather(1, (k - 1)[:, None])  # [num_seqs, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly more likely tokens
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
