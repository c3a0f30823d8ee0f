"""Speculative decoding by a draft model: a smaller model with the target's tokenizer
proposes its greedy continuation of each speculating sequence.

Greedy proposals. vLLM samples the draft's proposals from its distribution q and checks
them against q; we propose the draft's argmax, so q is a point mass on each proposal and
`speculative.verify` stays one rule for every proposer (accept d with probability p(d),
else draw from p without d), lossless for any deterministic proposer. An argmax is also
the same on every rank without sharing a random stream.

One block manager. The draft's KV lives in a cache of its own (one K/V tensor pair per
draft layer, plus a swap space), with the target's number of blocks and block size, and
is addressed by the target's block ids: block b of a sequence holds its target KV in the
target cache and its draft KV in the draft cache. So the scheduler's one allocator, its
block tables, prefix cache, copy on write, preemption and swap cover both; a block's
bytes are the target's plus the draft's (`ModelRunner.bytes_per_block`), and every block
move moves both. A block's draft KV is valid wherever its target KV is, with one
exception: when every proposal is accepted, the last one's position was never fed to the
draft (its KV is computed the next step); a sequence that ends right then leaves that
position's draft KV stale for a later prefix-cache hit. A stale draft KV only lowers
acceptance: the target checks every proposal.

Each step, on every rank (the draft is loaded like the target, sharded under tensor
parallelism; its logits reach rank 0, whose argmax is broadcast):

    catch up      one forward over each scheduled sequence's tokens from what the draft
                  has computed (`draft_computed`) up to the tokens the target knows this
                  step: prompts chunk by chunk, then each decode's last token, whose
                  logits give a speculating sequence's proposal 1
    propose       k - 1 one-token forwards of the speculating sequences, feeding proposal
                  j to get proposal j + 1
    settle        after the target's check: draft_computed = min(draft_computed, tokens
                  the target computed), since rejected proposals' draft KV is stale

A sequence that starts over (preempted to recompute) or starts from a prefix-cache hit
starts the draft at the target's `start`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from serve import kernels
from serve.config import ModelConfig, SpeculativeMethod
from serve.distributed.parallel_state import get_tp_group
from serve.kv_cache.cache_engine import CacheEngine
from serve.models.forward_context import forward_context
from serve.models.loader import load_hf_config, load_model, model_max_len, resolve_model_path
from serve.models.registry import get_arch_config
from serve.step import SchedulerOutput
from serve.worker.model_inputs import QuerySpan, paged_attention_inputs
from serve.worker.model_kv import ModelKV
from serve.worker.sequence_mirror import MirroredSequence, SequenceMirror


def draft_model_path(method: SpeculativeMethod, load_format: str) -> Path:
    """The draft's checkpoint directory; a missing one is named as the draft."""
    assert method.model is not None
    try:
        return resolve_model_path(method.model, load_format)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"speculative_config's draft model: {e}") from None


def draft_max_len(method: SpeculativeMethod, model_config: ModelConfig) -> int:
    """The longest context the draft supports. It runs at the target's positions, so the
    engine core fits max_model_len to it too (`fit_max_model_len`)."""
    hf_config = load_hf_config(draft_model_path(method, model_config.load_format))
    return model_max_len(get_arch_config(hf_config, model_config.model_impl))


@dataclass
class _Running:
    """A sequence in this step's draft forwards."""

    seq: MirroredSequence
    token_ids: list[int]  # what the catch-up forward feeds it
    known_end: int  # the tokens the target knows this step (its last one's logits: proposal 1)
    num_proposals: int  # the room the scheduler made for proposals (0: not speculating)


class DraftModelProposer:
    def __init__(
        self,
        method: SpeculativeMethod,
        model_config: ModelConfig,
        target_hf_config: Any,
        block_size: int,
        device: torch.device,
        kv_cache_dtype: str = "auto",
    ) -> None:
        path = draft_model_path(method, model_config.load_format)
        hf_config = load_hf_config(path)
        draft_vocab, target_vocab = int(hf_config.vocab_size), int(target_hf_config.vocab_size)
        if draft_vocab != target_vocab:
            raise ValueError(
                f"speculative_config's draft model {method.model} has a vocabulary of "
                f"{draft_vocab} tokens, the target model {target_vocab}: a draft must share "
                "the target's tokenizer."
            )
        self.block_size, self.device = block_size, device
        self.model = load_model(model_config, path, hf_config, device)
        self.kv = ModelKV.of(self.model, kv_cache_dtype)
        self.cache_engine: CacheEngine | None = None
        self.draft_computed: dict[int, int] = {}  # seq id -> positions with draft KV

    # -- the draft's KV cache --------------------------------------------------------------------

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """The target's block count and swap space: the same block ids address both."""
        self.cache_engine = self.kv.attach_cache(
            self.model, num_blocks, self.block_size, self.device, num_cpu_blocks
        )

    # -- one step --------------------------------------------------------------------------------

    def propose_step(self, out: SchedulerOutput, mirror: SequenceMirror) -> dict[int, list[int]]:
        """Catch the draft up with every scheduled sequence and propose for the speculating
        ones (seq id -> its proposals). Runs after the step's block moves; every rank calls
        it alike (the forwards are collectives under tensor parallelism)."""
        for parent_id, child_id in out.forked_seqs:
            if parent_id in self.draft_computed:
                self.draft_computed[child_id] = self.draft_computed[parent_id]
        running: list[_Running] = []
        spans: list[QuerySpan] = []
        for s in out.scheduled:
            seq = mirror[s.seq_id]
            params = seq.sampling_params
            if params.pooling is not None or params.use_beam_search:
                continue  # never speculates: the draft has nothing to do for it
            known_end = s.start + s.num_new_tokens - s.num_spec_tokens
            # Unknown (new, forked) or started again earlier: the draft starts where the
            # target does; the blocks before `start` hold both models' KV.
            begin = min(self.draft_computed.get(s.seq_id, s.start), s.start)
            tokens = seq.token_ids_between(begin, known_end)
            running.append(_Running(seq, tokens, known_end, s.num_spec_tokens))
            spans.append(QuerySpan(seq.block_table, begin, known_end - begin))
            self.draft_computed[s.seq_id] = known_end
        if not running:
            return {}
        # Decodes first, as attention batches them; the logits rows of the speculating.
        order = sorted(range(len(running)), key=lambda i: spans[i].count != 1)
        offsets, row = {}, 0
        for i in order:
            row += spans[i].count
            offsets[i] = row - 1  # the sequence's last known token
        token_ids = [t for i in order for t in running[i].token_ids]
        speculating = [i for i in order if running[i].num_proposals]
        num_decodes = sum(1 for i in order if spans[i].count == 1)
        proposals = self._forward(
            token_ids, [spans[i] for i in order], num_decodes, [offsets[i] for i in speculating]
        )
        drafts = {running[i].seq.seq_id: [t] for i, t in zip(speculating, proposals)}
        for j in range(1, max((running[i].num_proposals for i in speculating), default=0)):
            more = [i for i in speculating if running[i].num_proposals > j]
            step_spans = [
                QuerySpan(running[i].seq.block_table, running[i].known_end + j - 1, 1) for i in more
            ]
            fed = [drafts[running[i].seq.seq_id][-1] for i in more]
            proposals = self._forward(fed, step_spans, len(more), list(range(len(more))))
            for i, token in zip(more, proposals):
                drafts[running[i].seq.seq_id].append(token)
                self.draft_computed[running[i].seq.seq_id] += 1
        return drafts

    def _forward(
        self, token_ids: list[int], spans: list[QuerySpan], num_decodes: int, rows: list[int]
    ) -> list[int]:
        """One draft forward of `spans`; the draft's greedy token at each of `rows`."""
        positions, meta = paged_attention_inputs(spans, self.block_size, num_decodes, self.device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        with forward_context(meta):
            hidden = self.model(ids, positions)  # [num_tokens, hidden]
        if not rows:
            return []
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[index])  # [len(rows), vocab]; None off rank 0
        group = get_tp_group()
        if group.world_size == 1:
            return kernels.argmax(logits).tolist()
        tokens = (
            kernels.argmax(logits)
            if logits is not None
            else torch.empty(len(rows), dtype=torch.long, device=self.device)
        )
        return group.broadcast(tokens.contiguous(), src=0).tolist()

    def settle(self, out: SchedulerOutput, mirror: SequenceMirror) -> None:
        """After the step's tokens are appended: the draft's KV past what the target
        computed (rejected proposals) is stale."""
        for s in out.scheduled:
            computed = self.draft_computed.get(s.seq_id)
            if computed is not None and s.seq_id in mirror.seqs:
                # The target computed every known token but the newest (sampled, unfed).
                target_computed = mirror[s.seq_id].num_tokens - 1
                self.draft_computed[s.seq_id] = min(computed, target_computed)

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.draft_computed.pop(seq_id, None)
