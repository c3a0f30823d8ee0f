"""The plain data of one engine step between the scheduler and the workers.

    scheduler.schedule() ──▶ SchedulerOutput ──▶ executor ──▶ every worker (rank)
    scheduler.update_from_output() ◀── ModelRunnerOutput ◀── the driver worker (rank 0)

Only ids, ints, floats, strings and lists of them: no live objects, so a step crosses a
thread, a pipe or a Ray call alike. The workers keep a mirror of every sequence they have
been sent (its tokens, its block table, its sampling state), so a step sends each new
sequence once, with its prompt, and after that only what changed:

- `new_seqs`: sequences the workers have not seen (prompt tokens, parameters, grammar);
- `forked_seqs`, `appended_token_ids`: beam search's forks and the tokens it chose, which
  the workers did not sample themselves (applied before anything else, in that order);
- `finished_seq_ids`: sequences the workers forget (after the forks that copy them);
- `scheduled`: per sequence, the tokens to compute, its block table's change, and
  whether its next token is sampled;
- the KV block moves: swap-outs, swap-ins, then copy-on-write copies.

A worker appends every token it samples to its mirror itself, so a decode step needs no
token from the scheduler, and a step scheduled before the previous one has sampled (async
scheduling) is complete as sent. A steady decode step costs O(batch) bytes, whatever the
contexts' lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve.lora_request import LoRARequest
from serve.multimodal_inputs import MultiModalInput
from serve.sampling_params import SamplingParams

BlockCopy = tuple[int, int]  # (source block id, destination block id)


@dataclass
class NewSequence:
    """A sequence the workers have not seen. Later steps refer to it by `seq_id`."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int | None  # its own random stream (None: the workers' shared one)
    # The compiled grammar (xgrammar's serialized JSON) for structured output, else None.
    grammar: str | None = None
    lora: LoRARequest | None = None  # the adapter its forward passes apply
    mm_inputs: tuple[MultiModalInput, ...] = ()  # its prompt's images


@dataclass
class ScheduledSequence:
    """One sequence's share of the step."""

    seq_id: int
    start: int  # the first position computed this step
    num_new_tokens: int  # tokens whose K/V this step computes: positions [start, start + n)
    # The block table's change since the workers last saw it: `table[table_start:]` is
    # replaced by `block_ids` (growth appends; a swap-in or a recompute replaces it all;
    # copy-on-write replaces the block written first).
    table_start: int
    block_ids: list[int]
    # This step reaches the sequence's last token, so its next one is sampled (False for a
    # prefill chunk that stops short of it, and always for a prefill-only request, which
    # samples nothing: the workers see from its params and prompt length where it ends).
    is_sampled: bool
    # `best_of` > 1, sampled for the first time: the row is sampled once more for each id
    # here, and each id becomes a new sequence copying this one (a fork with a seed of
    # its own). The workers create them; the scheduler adds them when it updates.
    fork_seq_ids: list[int] = field(default_factory=list)
    # Speculative decoding: the last `num_spec_tokens` positions of the range are room for
    # proposals, which the workers make themselves (they may find fewer, even none) and
    # check in this step's forward; the sequence then takes 1 to 1 + proposals tokens.
    num_spec_tokens: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    new_seqs: list[NewSequence] = field(default_factory=list)
    forked_seqs: list[BlockCopy] = field(default_factory=list)  # (parent seq id, child seq id)
    appended_token_ids: list[tuple[int, list[int]]] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    # Block moves the workers make before the forward pass, in this order: swap-outs read
    # blocks that swap-ins and copies may then overwrite.
    blocks_to_swap_out: list[BlockCopy] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[BlockCopy] = field(default_factory=list)  # (cpu, device)
    blocks_to_copy: list[BlockCopy] = field(default_factory=list)  # (src, dst) copy-on-write
    # For the engine, not the workers: requests preempted this step (for logs and tests),
    # and whether sampling this step forks or drops sequences (beam search, the first
    # sample of `best_of`), in which case the next step cannot be scheduled before the
    # scheduler has seen this one's output.
    preempted_request_ids: list[str] = field(default_factory=list)
    forks_sequences: bool = False

    @property
    def speculates(self) -> bool:
        return any(s.num_spec_tokens for s in self.scheduled)

    @property
    def next_waits_for_output(self) -> bool:
        """The next step cannot be scheduled before this one's output is in: its sampling
        forks sequences, or its sequences take a number of tokens known only then."""
        return self.forks_sequences or self.speculates

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (there may still be block moves or news for the mirrors)."""
        return not self.scheduled

    @property
    def has_block_moves(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)

    @property
    def has_worker_work(self) -> bool:
        """Anything for the workers to do or to learn; a step without it is not sent."""
        return bool(
            self.scheduled
            or self.has_block_moves
            or self.new_seqs
            or self.forked_seqs
            or self.appended_token_ids
            or self.finished_seq_ids
        )


@dataclass
class PromptLogprobs:
    """`prompt_logprobs` entries of a sequence's prompt positions [start + 1, start + 1 +
    len(entries)): each {token id: logprob} holds the prompt token and the top ones; `ranks`
    are the prompt tokens' ranks there (vLLM's: the tokens at least as likely, itself
    included)."""

    seq_id: int
    start: int
    entries: list[dict[int, float]]
    ranks: list[int]


@dataclass
class BeamCandidates:
    """A beam's best next tokens under the model (log-softmax of its logits, float32):
    enough for beam search to pick the step's best continuations over all beams."""

    seq_id: int
    token_ids: list[int]
    logprobs: list[float]
    # The position's top logprobs for a request that asked for them: every candidate, and
    # the best `logprobs` tokens when that is more.
    top_logprobs: dict[int, float] | None = None


@dataclass
class ModelRunnerOutput:
    """What the driver worker returns for one step: the sampled tokens as data.

    Row i of the sampled lists is sequence `seq_ids[i]` (a sequence forked this step, by
    its new id); beams are not sampled but scored (`beam_candidates`). A sequence that
    speculated has one row per token it takes, in order: the proposals accepted, then one
    sampled where the first was rejected (or after the last)."""

    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # Each token's logprob under the model; None where its request needs none
    # (SamplingParams.needs_logprobs: neither asked for nor ranked by them).
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    # Each token's rank under the model (vLLM's: the tokens at least as likely, itself
    # included); None where its request did not ask for `logprobs`.
    ranks: list[int | None] = field(default_factory=list)
    beam_candidates: list[BeamCandidates] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # Sequences whose grammar is complete (it took a stop token) or refused the token.
    grammar_ended_seq_ids: list[int] = field(default_factory=list)
    # Requests whose own processing raised in the worker (their sampling, their grammar):
    # request id -> what the client is told. They end; the rest of the batch runs on.
    failed_requests: dict[str, str] = field(default_factory=dict)
    # --scheduling-policy sjf: the model's final hidden state at the last prompt token of
    # each sequence that sampled its first token this step (seq id -> hidden state), a
    # feature of its output-length prediction.
    prompt_hidden_states: dict[int, list[float]] = field(default_factory=dict)
    # Pooling requests (max_tokens 0 with `pooling`) whose last prompt token this step
    # computed: seq id -> the pooled vector (truncated, normalised as their params say).
    # The worker's pooler owns it (worker/pooler.py); the sjf feature above is separate.
    pooled: dict[int, list[float]] = field(default_factory=dict)
    # Speculating sequences: seq id -> proposals checked this step, and how many of them
    # were accepted (its rows above are those, then one more).
    spec_proposed: dict[int, int] = field(default_factory=dict)
    spec_accepted: dict[int, int] = field(default_factory=dict)
    prepare_s: float = 0.0  # host time building the inputs
    forward_s: float = 0.0  # block moves, the forward pass and the logits
    sample_s: float = 0.0  # logits processing, sampling, logprobs
