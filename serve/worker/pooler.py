"""The driver worker's pooling: a pooling sequence's final hidden states into one vector.

A pooling request (pooling_params.py) is computed like any prompt, in chunks when the
step's budget says so. Each chunk's rows of the step's hidden states (after the model's
final norm, before the LM head) pass through here:

    last   the final chunk's last row
    mean   each chunk's rows are summed (float32) into the sequence's running total;
           the final chunk divides it by the prompt's length
    cls    the first chunk's first row, kept until the final chunk

The final chunk's vector is truncated to `dimensions` and L2-normalised when asked (in
that order, as vLLM does), and goes back in `ModelRunnerOutput.pooled` as plain floats.

A chunk starting at position 0 starts the sequence over: a recompute after preemption
computes its prompt again from the start. A chunk that does not continue where the last
one ended fails its request alone (it cannot be pooled correctly). Writers: the running
totals here are the pooler's alone, dropped when the sequence ends or is forgotten.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serve.outputs import request_error_message
from serve.pooling_params import PoolingParams
from serve.step import ModelRunnerOutput
from serve.worker.model_inputs import PoolSpan

logger = logging.getLogger(__name__)


@dataclass
class _Partial:
    """What the chunks computed so far contribute: a sequence's pooling in progress."""

    next_position: int  # where the next chunk must start
    total: torch.Tensor | None = None  # mean: the sum of the rows so far, float32 [hidden]
    first: torch.Tensor | None = None  # cls: the first row, float32 [hidden]


class Pooler:
    def __init__(self) -> None:
        self._partials: dict[int, _Partial] = {}  # seq id -> its pooling in progress

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._partials.pop(seq_id, None)

    def pool(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the step's final hidden states
        spans: list[PoolSpan],
        output: ModelRunnerOutput,
    ) -> None:
        """Take each pooling sequence's rows; put the vectors of those whose prompt this
        step finished in `output.pooled`. A request whose pooling raises fails alone."""
        finished: list[tuple[int, torch.Tensor]] = []  # (seq id, its final vector)
        for span in spans:
            seq = span.seq
            try:
                rows = hidden[span.offset : span.offset + span.count]  # [count, hidden]
                vector = self._take(span, rows)
                if vector is not None:
                    finished.append((seq.seq_id, _finish(vector, _params(span))))
            except Exception as e:
                logger.exception("Request %s: pooling failed; the batch runs on", seq.request_id)
                self._partials.pop(seq.seq_id, None)
                output.failed_requests.setdefault(seq.request_id, request_error_message(e))
        if not finished:
            return
        flat = torch.cat([v for _, v in finished]).cpu().tolist()  # one copy to the host
        start = 0
        for seq_id, vector in finished:
            output.pooled[seq_id] = flat[start : start + vector.numel()]
            start += vector.numel()

    def _take(self, span: PoolSpan, rows: torch.Tensor) -> torch.Tensor | None:
        """Fold one chunk in; the pooled vector (float32 [hidden]) once the chunk reaches
        the prompt's end, else None."""
        seq, end = span.seq, span.start + span.count
        is_final = end == seq.num_prompt_tokens
        kind = _params(span).pooling_type
        if kind == "last":
            return rows[-1].float() if is_final else None
        if span.start == 0:
            partial = self._partials[seq.seq_id] = _Partial(0)
        else:
            partial = self._partials.get(seq.seq_id)
            if partial is None or partial.next_position != span.start:
                known = None if partial is None else partial.next_position
                raise RuntimeError(
                    f"sequence {seq.seq_id}: a chunk at positions [{span.start}, {end}) "
                    f"does not continue the pooled ones (next expected: {known})"
                )
        partial.next_position = end
        if kind == "mean":
            chunk_sum = rows.float().sum(dim=0)  # [hidden]
            partial.total = chunk_sum if partial.total is None else partial.total + chunk_sum
        elif partial.first is None:  # cls
            partial.first = rows[0].float()
        if not is_final:
            return None
        del self._partials[seq.seq_id]
        if kind == "mean":
            assert partial.total is not None
            return partial.total / seq.num_prompt_tokens
        assert partial.first is not None
        return partial.first


def _params(span: PoolSpan) -> PoolingParams:
    params = span.seq.sampling_params.pooling
    if params is None or params.pooling_type is None or params.normalize is None:
        raise ValueError("pooling params must be resolved by the engine core first")
    return params


def _finish(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Matryoshka truncation, then the L2 norm (vLLM's order)."""
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = F.normalize(vector, p=2.0, dim=-1)
    return vector
