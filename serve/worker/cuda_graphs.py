"""Decode steps replayed from captured CUDA graphs.

On a GPU a decode step of a small batch is mostly host time: some 300 kernel launches, each
tens of µs of Python and driver work, against 1-10 ms of device work (benchmarks/RESULTS.md,
"On a GPU"). A CUDA graph records one forward's launches once; a replay issues them all in
one call. vLLM and SGLang capture their decode steps the same way.

One graph per batch size in `capture_sizes` (1, 2, 4, 8, then every 8th). A step of B
decodes replays the smallest captured size >= B, its rows past B padded: token 0 at position
0, no cache slot (-1: nothing written), a context of one token (a read of block 0's first
slot, discarded). Prefill and extend steps, prompt logprobs, pooling and speculation's
multi-token queries run eagerly, as do decodes of more sequences than the largest size.

A replay repeats the recorded kernels on the recorded addresses with the recorded host-side
arguments, so everything a step varies lives in static device buffers written before each
replay (tokens, positions, slots, block tables, context lengths), and what the forward reads
on the host is fixed at capture: `seq_lens_cpu` says every context is the longest the block
table holds (the decode kernel then picks its split count for any length; it reads each
sequence's own length on the device), `query_lens_cpu` ones. That is only sound for a forward
that reads nothing else on the host: serve's own model classes on the Triton kernels, at one
rank (`ineligibility` says why a model is not).

`DecodeGraphs(capture=False)` runs each "replay" as an eager forward over the same static
buffers and the same fixed host metadata: what the graphs would compute, without CUDA. The
tests run it on CPU under Triton's interpreter.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from serve.kernels import AttentionMetadata, reference
from serve.kernels.backend import ops_for
from serve.models.forward_context import forward_context
from serve.worker.model_inputs import ModelInputs

logger = logging.getLogger(__name__)

# Eager forwards per size before its capture: the first compiles the Triton kernels for
# that shape and sets cuBLAS's workspace up, neither of which may happen during a capture.
WARMUP_FORWARDS = 2


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, then multiples of 8, up to `max_batch`
    (itself included, so that a full batch pads to no more than it)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sorted({*sizes, max_batch})


def ineligibility(
    model_impl: str, world_size: int, device: torch.device, model: nn.Module | None = None
) -> str | None:
    """Why this model's decode steps cannot be captured, or None if they can."""
    if device.type != "cuda":
        return f"they need a CUDA device, and this engine runs on {device.type}"
    if world_size > 1:
        return "tensor parallelism is not captured yet (its all-reduces run eagerly)"
    if model_impl != "native":
        return "transformers' modeling code may read tensors on the host mid-forward"
    if ops_for(device) is reference:  # on CUDA the one other backend than Triton
        return "SERVE_KERNEL_BACKEND=reference: its attention reads the host's metadata"
    reader = None if model is None else host_reader(model)
    if reader is not None:
        return (
            f"{reader} reads a tensor on the host every step (its experts run one at a "
            "time, as many rows as routed to each), which a capture cannot hold"
        )
    return None


def host_reader(model: nn.Module) -> str | None:
    """The first module whose forward waits on the device for a value every step (its
    `reads_host` is true: routed experts run one at a time, `kernels.reference.
    routed_experts`), or None. A capture fails on such a wait."""
    for name, module in model.named_modules():
        if getattr(module, "reads_host", False):
            return name
    return None


@dataclass
class _Graph:
    meta: AttentionMetadata  # over the static buffers' first `size` rows
    graph: torch.cuda.CUDAGraph | None  # None: replayed eagerly (capture=False)
    hidden: torch.Tensor | None  # [size, hidden_size], what a replay writes


class DecodeGraphs:
    """A model's decode forwards, one captured graph per batch size."""

    def __init__(
        self,
        model: nn.Module,
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        *,
        capture: bool = True,
    ) -> None:
        self.model, self.device, self.capture_graphs = model, device, capture
        self.sizes = capture_sizes(max_batch)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_context = max_blocks_per_seq * block_size
        self.replays = 0  # steps run from a graph (a counter for tests and logs)
        rows = self.sizes[-1]

        def buffer(fill: int, *shape: int) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.long, device=device)

        # The static inputs every graph reads; rows past a step's batch hold the padding.
        self._input_ids = buffer(0, rows)
        self._positions = buffer(0, rows)
        self._slots = buffer(-1, rows)
        self._seq_lens = buffer(1, rows)
        self._block_tables = buffer(0, rows, max_blocks_per_seq)
        self._query_start = torch.arange(rows + 1, dtype=torch.long, device=device)
        self._graphs: dict[int, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, the largest first: the later, smaller graphs reuse its memory."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self._graphs[size] = self._capture(size)
        if self.capture_graphs:
            torch.cuda.synchronize(self.device)
        logger.info(
            "Decode steps of up to %d sequences run as CUDA graphs: %d sizes captured in %.1f s",
            self.sizes[-1],
            len(self.sizes),
            time.perf_counter() - start,
        )

    def size_for(self, inputs: ModelInputs) -> int | None:
        """The captured size that runs this step, or None: it runs eagerly."""
        meta = inputs.meta
        num_seqs = meta.num_seqs
        if (
            num_seqs == 0
            or meta.num_decode_seqs != num_seqs
            or num_seqs > self.sizes[-1]
            or inputs.input_ids.shape[0] != num_seqs
            or inputs.prompt_logits_indices is not None
            or inputs.pool_spans
            or meta.block_tables.shape[1] > self.max_blocks_per_seq
        ):
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def run(self, inputs: ModelInputs, size: int) -> torch.Tensor:
        """The step's hidden states, [num_seqs, hidden_size], from the graph of `size`. The
        tensor is the graph's own output: read it before the next step replays."""
        meta, n = inputs.meta, inputs.meta.num_seqs
        self._input_ids[:n].copy_(inputs.input_ids)
        self._positions[:n].copy_(inputs.positions)
        self._slots[:n].copy_(meta.slot_mapping)
        self._seq_lens[:n].copy_(meta.seq_lens)
        self._block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if n < size:  # a larger step may have left real slots and lengths in these rows
            self._slots[n:size].fill_(-1)
            self._seq_lens[n:size].fill_(1)
        graph = self._graphs[size]
        if graph.graph is not None:
            graph.graph.replay()
            hidden = graph.hidden
        else:
            hidden = self._forward(graph.meta, size)
        assert hidden is not None
        self.replays += 1
        return hidden[:n]

    def _capture(self, size: int) -> _Graph:
        meta = AttentionMetadata(
            slot_mapping=self._slots[:size],
            block_tables=self._block_tables[:size],
            seq_lens=self._seq_lens[:size],
            query_start_loc=self._query_start[: size + 1],
            seq_lens_cpu=[self.max_context] * size,
            query_lens_cpu=[1] * size,
            num_decode_seqs=size,
        )
        if not self.capture_graphs:
            return _Graph(meta, None, None)
        for _ in range(WARMUP_FORWARDS):
            self._forward(meta, size)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self._forward(meta, size)
        return _Graph(meta, graph, hidden)

    def _forward(self, meta: AttentionMetadata, size: int) -> torch.Tensor:
        with forward_context(meta):
            return self.model(self._input_ids[:size], self._positions[:size])
