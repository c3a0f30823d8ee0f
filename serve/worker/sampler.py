"""Turn a batch of logits into one token per sequence, each with its own controls.

Every control is a batched tensor op over the rows that use it (logits_processors.py);
a batch where nobody uses a control skips it, and one where nobody uses any samples from
the model's logits without a copy. Greedy rows take the argmax of the processed logits;
logprobs are reported from the model's own, unprocessed ones, and only for the rows whose
request needs them. A token is drawn by inverse-CDF sampling, one uniform number per row:
a seeded request draws its number from its own generator, so its tokens never depend on
its batch. (One number per row, not one per vocabulary entry as the exponential-race
trick needs, keeps the draw cheap on CPU.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from serve import kernels
from serve.sequence import Sequence
from serve.worker import logits_processors as lp

# Edits processed logits [num_seqs, vocab] in place, setting disallowed tokens to -inf.
LogitsMask = Callable[[torch.Tensor], None]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Each sampled token's log-probability under the model; None where its request needs
    # none (SamplingParams.needs_logprobs).
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]  # per sequence that asked for `logprobs`
    # Each sampled token's rank in the model's distribution, as vLLM counts it: the tokens
    # whose logit is at least its own, itself included (1: the most likely). Only for the
    # sequences that asked for `logprobs`; None for the others.
    ranks: list[int | None]


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: Iterable[int] = ()) -> None:
        self._seed = seed
        self._eos_token_ids = sorted(set(eos_token_ids))  # masked until min_tokens
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

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], logits_mask: LogitsMask | None = None
    ) -> SamplerOutput:
        """One token per sequence (row of `logits`, [num_seqs, vocab] float32), chosen from
        the processed logits (`process_logits`); logprobs are reported from `logits` as
        the model gave them. `logits_mask` (structured output) sees the processed logits
        before temperature and filters."""
        params = [s.sampling_params for s in seqs]
        processed = self.process_logits(logits, seqs, logits_mask)
        token_ids = kernels.argmax(processed)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            random_seqs = [seqs[i] for i in random_rows]
            probs = self.probabilities(processed[rows], random_seqs)
            token_ids[rows] = self.draw(probs, self.uniform(random_seqs, logits.device))
        return self.report(logits, token_ids.tolist(), seqs)

    def report(
        self, logits: torch.Tensor, token_ids: list[int], seqs: list[Sequence]
    ) -> SamplerOutput:
        """Row i's token `token_ids[i]` with its logprob, and the top logprobs and rank its
        sequence asked for, under the model's own distribution (before temperature and
        filters), as vLLM reports them. Only the rows whose request needs a logprob
        (`SamplingParams.needs_logprobs`) are log-normalised, in one logsumexp over just
        those rows (logit - logsumexp avoids a full log_softmax), and only the rows that
        asked for `logprobs` are ranked (one comparison and sum over their row); the
        others get None, so a step where nobody needs one does no vocabulary-wide work
        here."""
        params = [s.sampling_params for s in seqs]
        logprobs: list[float | None] = [None] * len(seqs)
        top_logprobs: list[dict[int, float] | None] = [None] * len(seqs)
        ranks: list[int | None] = [None] * len(seqs)
        needing = [i for i, p in enumerate(params) if p.needs_logprobs]
        if not needing:
            return SamplerOutput(token_ids, logprobs, top_logprobs, ranks)
        device = logits.device
        rows = logits  # every row needs one: no copy
        if len(needing) < len(seqs):
            rows = logits.index_select(0, torch.tensor(needing, device=device))
        log_normalizer = torch.logsumexp(rows, dim=-1, keepdim=True)  # [num_needing, 1]
        index = torch.tensor([token_ids[i] for i in needing], device=device)[:, None]
        chosen = rows.gather(1, index)  # [num_needing, 1]
        sampled = (chosen - log_normalizer).squeeze(1).tolist()
        # vLLM's rank: the tokens at least as likely, itself included (ties share the
        # worst place). Compared as logits, which order the vocabulary as logprobs do.
        asking = [j for j, i in enumerate(needing) if params[i].logprobs is not None]
        if asking:
            if len(asking) < len(needing):
                at = torch.tensor(asking, device=device)
                counts = (rows.index_select(0, at) >= chosen.index_select(0, at)).sum(dim=-1)
            else:
                counts = (rows >= chosen).sum(dim=-1)  # [num_asking]
            for j, rank in zip(asking, counts.tolist()):
                ranks[needing[j]] = rank
        num_top = max(params[i].logprobs or 0 for i in needing)
        if num_top:
            top = rows.topk(num_top, dim=-1)
            top_ids, top_values = top.indices.tolist(), (top.values - log_normalizer).tolist()
        for j, i in enumerate(needing):
            logprobs[i] = sampled[j]
            num = params[i].logprobs
            if num is None:  # ranked by its logprobs, not asking for them
                continue
            entry = dict(zip(top_ids[j][:num], top_values[j][:num])) if num else {}
            entry[token_ids[i]] = sampled[j]
            top_logprobs[i] = entry
        return SamplerOutput(token_ids, logprobs, top_logprobs, ranks)

    def process_logits(
        self, logits: torch.Tensor, seqs: list[Sequence], logits_mask: LogitsMask | None = None
    ) -> torch.Tensor:
        """The logits greedy and sampling choose from, [num_seqs, vocab] float32: each
        request's controls applied to its row, in vLLM's order (allowed_token_ids,
        bad_words, min_tokens, logit_bias, then repetition, frequency and presence
        penalties), then `logits_mask`. `logits` is left unchanged, and returned as it is
        when nothing applies."""
        allowed: list[int] = []
        banned: dict[int, list[int]] = {}  # row -> bad-word and min_tokens bans
        biased: list[int] = []
        penalised: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.sampling_params
            if p.allowed_token_ids:
                allowed.append(i)
            row_bans = []
            if p.bad_words:
                row_bans += lp.banned_by_bad_words(p.bad_words_token_ids, seq.output_token_ids)
            if seq.num_output_tokens < p.min_tokens:  # its stop tokens (EOS, unless ignored)
                row_bans += [*([] if p.ignore_eos else self._eos_token_ids), *p.stop_token_ids]
            if row_bans:
                banned[i] = row_bans
                if p.allowed_token_ids and set(p.allowed_token_ids) <= set(row_bans):
                    # Sampled anyway, the row would yield a token outside allowed_token_ids.
                    raise ValueError(
                        "Every token in allowed_token_ids is banned at this point of the "
                        "output (by bad_words, or held back by min_tokens): no token can "
                        "be generated."
                    )
            if p.logit_bias:
                biased.append(i)
            if p.has_penalties:
                penalised.append(i)
        if not (allowed or banned or biased or penalised) and logits_mask is None:
            return logits

        logits = logits.clone()
        device = logits.device
        if allowed:
            ids = [seqs[i].sampling_params.allowed_token_ids or [] for i in allowed]
            lp.keep_only_tokens(logits, *lp.coordinates(allowed, ids, device))
        if banned:
            lp.ban_tokens(logits, *lp.coordinates(list(banned), list(banned.values()), device))
        if biased:
            biases = [seqs[i].sampling_params.logit_bias or {} for i in biased]
            rows, ids = lp.coordinates(biased, [list(b) for b in biases], device)
            values = torch.tensor([v for b in biases for v in b.values()], device=device)
            lp.add_logit_bias(logits, rows, ids, values)
        if penalised:
            self._apply_penalties(logits, [seqs[i] for i in penalised], penalised)
        if logits_mask is not None:
            logits_mask(logits)
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        """Count each penalised row's tokens (prompt tokens only for rows with a repetition
        penalty) and apply the penalties; `seqs[j]` is batch row `rows[j]`."""
        device, vocab_size = logits.device, logits.shape[1]
        params = [s.sampling_params for s in seqs]
        local = list(range(len(seqs)))
        output_counts = lp.count_tokens(
            *lp.coordinates(local, [s.output_token_ids for s in seqs], device),
            len(seqs),
            vocab_size,
        )
        prompt_counts = None
        if any(p.repetition_penalty != 1.0 for p in params):
            prompts = [
                s.prompt_token_ids if p.repetition_penalty != 1.0 else []
                for s, p in zip(seqs, params)
            ]
            prompt_counts = lp.count_tokens(
                *lp.coordinates(local, prompts, device), len(seqs), vocab_size
            )
        penalties = torch.tensor(
            [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
            device=device,
        )
        rows_t = torch.tensor(rows, device=device)
        lp.apply_penalties(logits, rows_t, output_counts, prompt_counts, penalties)

    def probabilities(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The distribution each row's token is drawn from, [num_seqs, vocab]: processed
        logits under the row's temperature, then min-p, top-k and top-p, in vLLM's order
        (min-p first: top-p's nucleus is then taken from what min-p left, renormalised)."""
        params = [s.sampling_params for s in seqs]
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temperature[:, None]
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
            probs = torch.softmax(logits, dim=-1)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if any(p.top_k for p in params):
            logits = _apply_top_k(logits, [p.top_k for p in params])
        if any(p.top_p < 1.0 for p in params):
            logits = _apply_top_p(logits, torch.tensor([p.top_p for p in params], device=device))
        return torch.softmax(logits, dim=-1)

    def uniform(self, seqs: list[Sequence], device: torch.device) -> torch.Tensor:
        """One uniform number per row, [num_seqs]: a seeded sequence's from its own
        generator, the others' from the shared one."""
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
        return uniform

    @staticmethod
    def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """Row i's token by inverse-CDF sampling of `probs[i]` (unnormalised) at `uniform[i]`."""
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
    """Keep each row's smallest set of most likely tokens whose probability reaches its
    top_p, and every token as likely as the least likely of them (ties at the edge stay
    together, whatever order a sort would give them); rows with top_p 1 keep every token.
    The edge is `kernels.top_p_cut`'s: on CPU a selection, never a sort of the vocabulary."""
    rows = (top_p < 1.0).nonzero().flatten()
    if rows.numel() == 0:
        return logits
    every_row = rows.numel() == logits.shape[0]
    limited, limits = (logits, top_p) if every_row else (logits[rows], top_p[rows])
    narrowed = limited.masked_fill(limited < kernels.top_p_cut(limited, limits), float("-inf"))
    if every_row:
        return narrowed
    out = logits.clone()
    out[rows] = narrowed
    return out
