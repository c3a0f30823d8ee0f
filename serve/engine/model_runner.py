"""Owns the model and its KV cache; turns a SchedulerOutput into one batched forward pass."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from serve.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from serve.kernels import AttentionMetadata, copy_blocks, swap_blocks
from serve.kv_cache.cache_engine import CacheEngine, kv_bytes_per_block
from serve.models.forward_context import forward_context
from serve.models.loader import load_model
from serve.scheduler.output import SchedulerOutput
from serve.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class PromptSpan:
    """Prompt positions [start, start + count) of a sequence that asked for prompt
    logprobs; their logits (each predicting the next prompt token) are rows
    [offset, offset + count) of `ModelOutput.prompt_logits`."""

    seq: Sequence
    start: int
    count: int
    offset: int


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [num_sampled, vocab] float32, one row per sampled sequence
    sampled_seqs: list[Sequence]
    prompt_logits: torch.Tensor | None = None  # [sum of span counts, vocab] float32
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    prepare_s: float = 0.0  # host time building the inputs
    forward_s: float = 0.0  # block moves, the forward pass and the logits


@dataclass
class ModelInputs:
    # [num_tokens]; None while some tokens are still being sampled (see `late_tokens`)
    input_ids: torch.Tensor | None
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled]: the last token of each sampled sequence
    sampled_seqs: list[Sequence]
    prompt_logits_indices: torch.Tensor | None = None  # rows for prompt logprobs
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    prepare_s: float = 0.0
    # Scheduled ahead of the step that samples them (async scheduling): the input tokens
    # not known at prepare time, as (index in `token_ids`, sequence, position). `run`
    # fills them in from the sequences and builds `input_ids`.
    token_ids: list[int] = field(default_factory=list)
    late_tokens: list[tuple[int, Sequence, int]] = field(default_factory=list)

    def input_ids_now(self, device: torch.device) -> torch.Tensor:
        """`input_ids`, with the late tokens now sampled. A sequence that ended without
        its token (failed) computes a dummy one in vain."""
        if self.input_ids is None:
            for index, seq, position in self.late_tokens:
                self.token_ids[index] = seq.token_at(position) if position < seq.num_tokens else 0
            self.input_ids = _long_tensor(self.token_ids, device)
        return self.input_ids


def _long_tensor(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_path: Path, hf_config: Any, device: torch.device
    ) -> None:
        self.config, self.device = config, device
        self.block_size = config.cache.block_size
        self.model = load_model(config.model, model_path, hf_config, device)
        attn = self.model.attention_layers
        self.dtype = next(self.model.parameters()).dtype
        self.num_layers = len(attn)
        self.num_kv_heads, self.head_dim = attn[0].num_kv_heads, attn[0].head_dim
        self.num_blocks = self._num_kv_blocks()
        self.num_cpu_blocks = config.cache.swap_space_bytes // self.bytes_per_block
        self.cache_engine = CacheEngine(
            self.num_layers,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            device,
            self.num_cpu_blocks,
        )
        for layer, kv_cache in zip(attn, self.cache_engine.kv_caches):
            layer.kv_cache = kv_cache

    @property
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type == "cuda":
            budget = self._profile_free_cuda_memory()
        else:
            budget = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = int(budget // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError(
                f"No room for a single KV block ({self.bytes_per_block} bytes) in the "
                f"{budget / 2**30:.2f} GiB left for the KV cache. Raise --kv-cache-memory "
                "or --gpu-memory-utilization."
            )
        return num_blocks

    def _profile_free_cuda_memory(self) -> float:
        """Total memory x utilisation, minus the peak of a forward pass at full token budget."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.config.scheduler.max_num_batched_tokens or 8192
        dummy = CacheEngine(
            self.num_layers,
            1,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.device,
        )
        layers = self.model.attention_layers
        for layer, kv_cache in zip(layers, dummy.kv_caches):
            layer.kv_cache = kv_cache
        num_table_blocks = -(-num_tokens // self.block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            block_tables=torch.zeros((1, num_table_blocks), dtype=torch.long, device=self.device),
            seq_lens=torch.tensor([num_tokens], device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], device=self.device),
            seq_lens_cpu=[num_tokens],
            query_lens_cpu=[num_tokens],
            num_decode_seqs=0,
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        with torch.inference_mode(), forward_context(meta):
            self.model.compute_logits(self.model(ids, torch.arange(num_tokens, device=self.device)))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        for layer in layers:
            layer.kv_cache = None
        del dummy
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return total * self.config.cache.gpu_memory_utilization - peak

    def prepare_inputs(self, sched: SchedulerOutput) -> ModelInputs:
        # Decodes first (stable), so attention can batch them in one gather.
        ordered = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)
        num_decode_seqs = sum(1 for s in ordered if s.num_new_tokens == 1)
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logits_indices: list[int] = []
        sampled: list[Sequence] = []
        prompt_indices: list[int] = []
        prompt_spans: list[PromptSpan] = []
        late_tokens: list[tuple[int, Sequence, int]] = []
        for s in ordered:
            seq, start, n, table = s.seq, s.start, s.num_new_tokens, s.block_table
            known = min(start + n, seq.num_tokens)  # later ones are still being sampled
            if n == 1 and known > start:
                token_ids.append(seq.token_at(start))
            else:
                token_ids.extend(seq.token_ids_between(start, known))
            for position in range(max(start, known), start + n):
                late_tokens.append((len(token_ids), seq, position))
                token_ids.append(0)
            if seq.sampling_params.prompt_logprobs is not None:
                # Position p's logits predict prompt token p + 1; the last prompt position
                # predicts the first output token, which the sampler reports.
                count = min(start + n, seq.num_prompt_tokens - 1) - start
                if count > 0:
                    prompt_spans.append(PromptSpan(seq, start, count, len(prompt_indices)))
                    prompt_indices.extend(range(len(positions), len(positions) + count))
            span = range(start, start + n)
            positions.extend(span)
            slots.extend(table[p // bs] * bs + p % bs for p in span)
            seq_lens.append(start + n)
            query_lens.append(n)
            if s.is_sampled:
                logits_indices.append(len(token_ids) - 1)
                sampled.append(seq)
        max_blocks = max(len(s.block_table) for s in ordered)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in ordered]
        query_start_loc = [0]
        for n in query_lens:
            query_start_loc.append(query_start_loc[-1] + n)

        def tensor(values: list) -> torch.Tensor:
            return _long_tensor(values, self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots),
            block_tables=tensor(tables),
            seq_lens=tensor(seq_lens),
            query_start_loc=tensor(query_start_loc),
            seq_lens_cpu=seq_lens,
            query_lens_cpu=query_lens,
            num_decode_seqs=num_decode_seqs,
        )
        return ModelInputs(
            None if late_tokens else tensor(token_ids),
            tensor(positions),
            meta,
            tensor(logits_indices),
            sampled,
            tensor(prompt_indices) if prompt_indices else None,
            prompt_spans,
            token_ids=token_ids,
            late_tokens=late_tokens,
        )

    def prepare(self, sched: SchedulerOutput) -> ModelInputs | None:
        """The step's input tensors (None for a step that only moves blocks). Tokens still
        being sampled by the step before are left for `run` to fill in."""
        if sched.is_empty:
            return None
        start = time.perf_counter()
        inputs = self.prepare_inputs(sched)
        inputs.prepare_s = time.perf_counter() - start
        return inputs

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput, inputs: ModelInputs | None) -> ModelOutput:
        """The KV block moves, then the forward pass and the logits. Reads only `inputs`,
        the KV cache and the late tokens' sequences (appended to only by the sampler, on
        this thread), so the engine's helper thread may finish the previous step's
        outputs and schedule the next step meanwhile."""
        start = time.perf_counter()
        self._move_blocks(sched)
        if inputs is None:
            return ModelOutput(torch.empty(0, 0), [], forward_s=time.perf_counter() - start)
        input_ids = inputs.input_ids_now(self.device)
        with forward_context(inputs.meta):
            hidden = self.model(input_ids, inputs.positions)  # [num_tokens, hidden]
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        prompt_logits = None
        if inputs.prompt_logits_indices is not None:
            prompt_logits = self.model.compute_logits(hidden[inputs.prompt_logits_indices]).float()
        logits = logits.float()
        return ModelOutput(
            logits,
            inputs.sampled_seqs,
            prompt_logits,
            inputs.prompt_spans,
            prepare_s=inputs.prepare_s,
            forward_s=time.perf_counter() - start,
        )

    def _move_blocks(self, sched: SchedulerOutput) -> None:
        """Swap out, swap in, then copy on write: swap-outs read blocks that the scheduler
        has already handed to others, who may overwrite them with the later moves."""
        device_caches = self.cache_engine.kv_caches
        swap_caches = self.cache_engine.swap_caches
        for pairs, src_caches, dst_caches in (
            (sched.blocks_to_swap_out, device_caches, swap_caches),
            (sched.blocks_to_swap_in, swap_caches, device_caches),
        ):
            if not pairs:
                continue
            src_ids, dst_ids = zip(*pairs)
            for src_kv, dst_kv in zip(src_caches, dst_caches):
                src_index = torch.tensor(src_ids, device=src_kv[0].device)
                dst_index = torch.tensor(dst_ids, device=dst_kv[0].device)
                for src, dst in zip(src_kv, dst_kv):
                    swap_blocks(src, dst, src_index, dst_index)
        if sched.blocks_to_copy:
            src_ids, dst_ids = zip(*sched.blocks_to_copy)
            copy_blocks(
                device_caches,
                torch.tensor(src_ids, device=self.device),
                torch.tensor(dst_ids, device=self.device),
            )
