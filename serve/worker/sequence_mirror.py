"""The worker's persistent batch state: a mirror of every sequence it has been sent.

Each step's SchedulerOutput carries only what changed (step.py); `SequenceMirror.apply`
folds it into the mirror, which then holds, for every sequence the scheduler has not
finished, the tokens the worker knows (the prompt, every token it sampled, the tokens
beam search chose) and its block table. Input tensors are built from the mirror alone.

Every rank keeps the same mirror: the ranks apply the same messages, and the tokens the
driver samples reach the other ranks by a broadcast (worker.py) before they append them.

Writers: `apply` (from the scheduler's messages) and `fork_sample` / `append_sampled`
(after each step's sampling), called by the model runner only.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from serve.lora_request import LoRARequest
from serve.multimodal_inputs import MultiModalInput
from serve.sampling_params import SamplingParams
from serve.step import SchedulerOutput


@dataclass(eq=False)
class MirroredSequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int | None  # its own random stream (None: the shared one)
    output_token_ids: list[int] = field(default_factory=list)
    # int64 in an array, not a list: model_inputs copies each step's tables row by row
    # into one numpy array, a memcpy from an array (~5x faster than from a list).
    block_table: array = field(default_factory=lambda: array("q"))
    lora: LoRARequest | None = None
    mm_inputs: tuple[MultiModalInput, ...] = ()  # its prompt's images

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) (a per-step hot path: no full list built)."""
        num_prompt = self.num_prompt_tokens
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def copy(self, seq_id: int, seed: int | None) -> MirroredSequence:
        """A fork: the same tokens and blocks (the prompt list is shared: it never changes)."""
        return MirroredSequence(
            seq_id,
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            seed,
            list(self.output_token_ids),
            array("q", self.block_table),
            self.lora,
            self.mm_inputs,
        )


class SequenceMirror:
    def __init__(self) -> None:
        self.seqs: dict[int, MirroredSequence] = {}

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, seq_id: int) -> MirroredSequence:
        return self.seqs[seq_id]

    def apply(self, out: SchedulerOutput) -> list[int]:
        """Fold one step's news in, in the order the scheduler recorded it: forks copy
        their parents before the parents take the tokens appended with them, and
        finished parents go after their forks. Returns the sequence ids forgotten."""
        for parent_id, child_id in out.forked_seqs:
            self.seqs[child_id] = self.seqs[parent_id].copy(child_id, None)
        for seq_id, token_ids in out.appended_token_ids:
            self.seqs[seq_id].output_token_ids += token_ids
        forgotten = [seq_id for seq_id in out.finished_seq_ids if self.seqs.pop(seq_id, None)]
        for new in out.new_seqs:
            self.seqs[new.seq_id] = MirroredSequence(
                new.seq_id,
                new.request_id,
                list(new.prompt_token_ids),
                new.params,
                new.seed,
                lora=new.lora,
                mm_inputs=new.mm_inputs,
            )
        for s in out.scheduled:
            table = self.seqs[s.seq_id].block_table
            del table[s.table_start :]
            table.extend(s.block_ids)
        return forgotten

    def fork_sample(self, parent_id: int, child_id: int, seed: int | None) -> MirroredSequence:
        """`best_of`'s first sample: `child_id` copies the prompt sequence before it takes
        its token; the scheduler adds the same fork when it reads the step's output."""
        child = self.seqs[parent_id].copy(child_id, seed)
        self.seqs[child_id] = child
        return child

    def append_sampled(self, seq_ids: list[int], token_ids: list[int]) -> None:
        for seq_id, token_id in zip(seq_ids, token_ids):
            seq = self.seqs.get(seq_id)
            if seq is not None:
                seq.output_token_ids.append(token_id)
