"""ModelRunner: one rank's model and KV cache; turns a SchedulerOutput into one batched
forward pass, and (on the driver) the step's sampled tokens.

    execute_model(out):
        mirror.apply(out)          the scheduler's news: new sequences, forks, tables, ends
        block moves                swap out, swap in, copy on write
        inputs from the mirror     tokens, positions, slots, block tables (model_inputs.py)
        forward, logits            every rank (tensor parallel: collectives inside); a
                                   decode step replays a CUDA graph on CUDA
        sample                     the driver (step_sampler.py); the tokens are broadcast
        pool                       the driver: pooling sequences' hidden states (pooler.py)
        mirror.append_sampled      every rank, so every mirror stays the same
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from serve.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    EngineConfig,
    GiB,
    available_memory_bytes,
    fit_max_num_batched_tokens,
)
from serve.kernels import AttentionMetadata, copy_blocks, swap_blocks
from serve.kernels.cpu import PACKED_MIN_ROWS, PREPACK_ENV_VAR, weights_packed
from serve.kv_cache.cache_engine import CacheEngine
from serve.models.arch_config import hf_text_config
from serve.models.forward_context import forward_context
from serve.models.layers.attention import attention_layers
from serve.models.layers.lora import lora_batch
from serve.models.loader import (
    dtype_name,
    load_model,
    model_max_len,
    resolve_dtype,
    weights_bytes,
)
from serve.models.quantization import quantization_config
from serve.models.registry import get_arch_config
from serve.models.tokenizer import load_tokenizer
from serve.step import ModelRunnerOutput, SchedulerOutput
from serve.worker.cuda_graphs import DecodeGraphs, ineligibility
from serve.worker.draft_model import DraftModelProposer
from serve.worker.lazy_structured_output import LazyStructuredOutput
from serve.worker.lora_manager import LoRAManager
from serve.worker.model_inputs import ModelInputs, build_model_inputs
from serve.worker.model_kv import ModelKV
from serve.worker.multimodal import ImageEmbeddings
from serve.worker.pooler import Pooler
from serve.worker.sequence_mirror import MirroredSequence, SequenceMirror
from serve.worker.speculative import before_grammar_start, make_proposer
from serve.worker.step_sampler import StepSampler

if TYPE_CHECKING:
    from serve.worker.worker import WorkerConfig

logger = logging.getLogger(__name__)

# The largest decode batch captured as a CUDA graph (vLLM's default bound too); larger
# decode steps run eagerly, where the launches weigh less beside the work.
MAX_CAPTURED_BATCH = 512
# Entries of the graphs' static block table (int64, rows x the longest context's blocks):
# 32 MiB. A model with no position limit may have a context as long as the whole cache;
# past this width (262k tokens at 512 rows of 16-token blocks) its steps run eagerly.
MAX_CAPTURED_TABLE_ENTRIES = 4 << 20


def _size(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / (1 << 20):.0f} MiB"


def _kv_cache_memory_flag(n: int) -> str:
    """A --kv-cache-memory of about 80% of `n` bytes, as a user would write it."""
    n = int(0.8 * n)
    return f"--kv-cache-memory {n >> 30}GiB" if n >= GiB else f"--kv-cache-memory {n >> 20}MiB"


# Memory the weights must leave free for a KV cache to be worth suggesting.
_LEAST_CACHE_ROOM = 256 << 20


def check_cpu_memory_before_loading(engine: EngineConfig, model_path: Path, hf_config: Any) -> None:
    """Memory past what is free brings the OOM killer, which ends the engine without a
    word, after minutes of loading a large model. So before any weight is read: the
    weights (at the dtype they will load as, twice over where a packed copy of each
    linear's is kept: serve.kernels.cpu.packed_weight) and the KV cache (zero-filled at
    start) against the memory available, refused with the numbers and what would fit.
    Every rank of a CPU engine runs on this host, so the weights are the whole
    checkpoint's."""
    dtype = resolve_dtype(engine.model.dtype, hf_config, torch.device("cpu"), log=False)
    weights = weights_bytes(model_path, engine.model.load_format, dtype)
    cache = engine.cache
    cache_bytes = 0  # a block count forced by hand: its bytes are known only once loaded
    if cache.num_gpu_blocks_override is None:
        cache_bytes = cache.cpu_kv_cache_bytes
    # The packed copies are of float linears: a quantized checkpoint's stay as they are.
    float_linears = quantization_config(hf_config) is None
    _check_memory_for(weights, cache_bytes, dtype, weights_packed(dtype) and float_linears)


def _check_memory_for(
    weights: int | None, cache_bytes: int, dtype: torch.dtype, packed: bool
) -> None:
    available = available_memory_bytes()
    if weights is None or available is None:
        return
    in_memory = weights * (2 if packed else 1)
    if in_memory + cache_bytes <= available:
        return
    held = f"{_size(weights)} in {dtype_name(dtype)}"
    if packed:
        held += ", twice that with the packed copy of each linear's"
    if in_memory + _LEAST_CACHE_ROOM <= available:
        fix = f"lower the cache, e.g. {_kv_cache_memory_flag(available - in_memory)}"
    else:
        fixes = ["--dtype bfloat16 (half the bytes)"] if dtype == torch.float32 else []
        if packed:
            fixes.append(f"{PREPACK_ENV_VAR}=0 (no packed copies; slower linears)")
        fixes.append("a smaller model, or a machine with more memory")
        fix = "the weights alone do not fit; try " + ", or ".join(fixes)
    raise ValueError(
        f"The model needs {_size(in_memory + cache_bytes)} of memory (its weights {held}; "
        f"the KV cache {_size(cache_bytes)}) and {_size(available)} is available: {fix}."
    )


def check_gpu_weights_fit(
    weights: int | None, world_size: int, free: int, dtype: torch.dtype, device: torch.device
) -> None:
    """A rank's share of the weights against its GPU's free memory, before any loads: past
    it, torch's out-of-memory error names neither the model nor the fix."""
    if weights is None or weights / world_size <= free:
        return
    # The fewest GPUs (a power of two, as head counts divide) whose shares leave a tenth
    # of the free memory to the activations and the KV cache.
    ranks = 1 << max(0, math.ceil(math.log2(weights / (0.9 * max(free, 1)))))
    fixes = [f"--tensor-parallel-size {ranks} ({_size(weights / ranks)} a GPU)"]
    if dtype == torch.float32:
        fixes.append("--dtype bfloat16 (half the bytes)")
    fixes.append("a smaller model")
    raise ValueError(
        f"The model's weights take {_size(weights)} in {dtype_name(dtype)}, "
        f"{_size(weights / world_size)} on each of {world_size} GPU(s), and {device} has "
        f"{_size(free)} free: try " + ", or ".join(fixes) + "."
    )


def check_gpu_cache_fits(cache_bytes: int, room: int, device: torch.device | str) -> None:
    """A --kv-cache-memory on a GPU is allocated whole at start: more than `room` (what is
    free once the weights are in, less a full step's activations) is refused with a size
    that fits, not an out-of-memory error halfway through the allocation."""
    if cache_bytes <= room:
        return
    fits = (
        f"lower it, e.g. {_kv_cache_memory_flag(room)}, or leave it out"
        if room >= 1 << 20
        else "leave it out"
    )
    raise ValueError(
        f"--kv-cache-memory {_size(cache_bytes)} does not fit in the {_size(max(room, 0))} "
        f"of {device} left beside the model's weights and a full step's activations: "
        f"{fits} to size the cache from --gpu-memory-utilization."
    )


def check_cpu_cache_fits(cache_bytes: int, num_blocks_override: int | None = None) -> None:
    """The CPU KV cache is zero-filled at start, so all of it is taken at once: more than
    the memory available now (the weights already loaded) would swap or bring the OOM
    killer. Refused with the numbers instead. (The check before loading estimated the
    weights; this one sees them.) `num_blocks_override`: the cache is that many blocks
    (--num-gpu-blocks-override), not --kv-cache-memory."""
    available = available_memory_bytes()
    if available is None or cache_bytes <= available:
        return
    if num_blocks_override is not None:
        raise ValueError(
            f"--num-gpu-blocks-override {num_blocks_override} takes {_size(cache_bytes)} of "
            f"KV cache, more than the {_size(available)} of memory available now (the "
            "model's weights loaded): lower it, or leave it out and size the cache with "
            f"{_kv_cache_memory_flag(available)}."
        )
    raise ValueError(
        f"--kv-cache-memory {_size(cache_bytes)} does not fit in the {_size(available)} of "
        f"memory available now (the model's weights loaded): lower it, e.g. "
        f"{_kv_cache_memory_flag(available)}."
    )


class ModelRunner:
    def __init__(self, config: WorkerConfig, hf_config: Any, device: torch.device) -> None:
        self.config, self.device, self.hf_config = config, device, hf_config
        engine = config.engine
        self.block_size = engine.cache.block_size
        # What other engines in this process held before this one loaded: not this one's.
        self._cuda_held_before = 0
        if device.type == "cuda":
            self._cuda_held_before = torch.cuda.memory_allocated(device)
            dtype = resolve_dtype(engine.model.dtype, hf_config, device, log=False)
            weights = weights_bytes(Path(config.model_path), engine.model.load_format, dtype)
            free, _ = torch.cuda.mem_get_info(device)
            check_gpu_weights_fit(weights, config.world_size, free, dtype, device)
        self.model = load_model(engine.model, Path(config.model_path), hf_config, device)
        self.kv = ModelKV.of(self.model, engine.cache.kv_cache_dtype)
        self.lora: LoRAManager | None = None
        if engine.lora.enable_lora:
            lora = engine.lora
            self.lora = LoRAManager(
                self.model, lora.max_loras, lora.max_lora_rank, lora.num_cpu_loras
            )
        # A model that takes images: their embeddings, encoded as steps reach them.
        self.images: ImageEmbeddings | None = None
        if hasattr(self.model, "embed_images"):
            self.images = ImageEmbeddings(self.model, device)
        self.mrope = hasattr(self.model, "multimodal_positions")
        self.cache_engine: CacheEngine | None = None
        self.graphs: DecodeGraphs | None = None  # on CUDA, once the cache is bound
        self.mirror = SequenceMirror()
        self.proposer = make_proposer(
            engine.speculative.method,
            engine.model,
            hf_config,
            self.block_size,
            device,
            engine.cache.kv_cache_dtype,
        )
        # A draft model has a KV cache of its own, addressed by the same block ids.
        self.draft = self.proposer if isinstance(self.proposer, DraftModelProposer) else None
        self.step_sampler: StepSampler | None = None
        self.pooler: Pooler | None = None
        if config.is_driver:
            self.pooler = Pooler()
            tokenizer_path = engine.model.tokenizer or config.model_path
            grammars = LazyStructuredOutput(
                lambda: load_tokenizer(tokenizer_path),
                int(hf_text_config(hf_config).vocab_size),
                config.eos_token_ids,
            )
            self.step_sampler = StepSampler(engine.model.seed, config.eos_token_ids, grammars)

    @property
    def bytes_per_block(self) -> int:
        """A block's KV bytes: the target's, and the draft model's KV for the same tokens."""
        target = self.kv.bytes_per_block(self.block_size)
        return target + (self.draft.kv.bytes_per_block(self.block_size) if self.draft else 0)

    # -- the KV cache ----------------------------------------------------------------------------

    def determine_num_blocks(self) -> tuple[int, int]:
        """KV blocks this rank has room for: on the device (or in CPU memory on CPU), and in
        the CPU swap space. On CPU, --kv-cache-memory is shared out among the ranks; on a
        GPU it is each GPU's (as vLLM's --kv-cache-memory-bytes)."""
        cache = self.config.engine.cache
        num_cpu_blocks = cache.swap_space_bytes // self.bytes_per_block
        if cache.num_gpu_blocks_override is not None:
            if self.device.type != "cuda":
                blocks = cache.num_gpu_blocks_override
                total = blocks * self.bytes_per_block * self.config.world_size
                check_cpu_cache_fits(total, num_blocks_override=blocks)
            return cache.num_gpu_blocks_override, num_cpu_blocks
        if self.device.type == "cuda":
            budget = self._profile_cuda_kv_cache_bytes()
        else:
            # A first forward of a few rows: the CPU linears pack their weights now, not
            # in the first request's time (~1 s for the default model). Fewer rows run on
            # the few-row kernel, which needs no packing.
            self._dummy_forward(PACKED_MIN_ROWS)
            total = cache.cpu_kv_cache_bytes
            check_cpu_cache_fits(total)
            budget = total / self.config.world_size
        num_blocks = int(budget // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError(
                f"No room for a single KV block ({self.bytes_per_block} bytes) in the "
                f"{budget / 2**30:.2f} GiB left for the KV cache. Raise --kv-cache-memory "
                "or --gpu-memory-utilization."
            )
        return num_blocks, num_cpu_blocks

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_engine = self.kv.attach_cache(
            self.model, num_blocks, self.block_size, self.device, num_cpu_blocks
        )
        if self.draft is not None:
            self.draft.initialize_cache(num_blocks, num_cpu_blocks)
        if self.config.engine.cuda_graphs and self.device.type == "cuda":
            if self.lora is not None:
                logger.info("Decode steps run eagerly, not as CUDA graphs, with LoRA enabled.")
            else:
                self.graphs = self._capture_decode_graphs(num_blocks)

    def _capture_decode_graphs(self, num_blocks: int) -> DecodeGraphs | None:
        """The decode graphs over the bound cache (whose addresses they record), or None
        with the reason logged when this model cannot replay them."""
        engine = self.config.engine
        arch = get_arch_config(self.hf_config, engine.model.model_impl)
        reason = ineligibility(arch.model_impl, self.config.world_size, self.device, self.model)
        if reason is None and hasattr(self.model, "multimodal_positions"):
            reason = "M-RoPE positions differ per sequence (a graph replays plain ones)"
        if reason is not None:
            logger.info("Decode steps run eagerly, not as CUDA graphs, because %s.", reason)
            return None
        # The engine's max_model_len, as the engine core fits it (and refuses one longer).
        longest = min(self._longest_prompt(), num_blocks * self.block_size)
        max_batch = min(engine.scheduler.max_num_seqs, MAX_CAPTURED_BATCH)
        graphs = DecodeGraphs(
            self.model,
            max_batch=max_batch,
            max_blocks_per_seq=min(
                -(-longest // self.block_size), MAX_CAPTURED_TABLE_ENTRIES // max_batch
            ),
            block_size=self.block_size,
            device=self.device,
        )
        try:
            graphs.capture()
        except Exception as e:
            raise RuntimeError(
                f"Capturing the decode steps as CUDA graphs failed ({e}). Start with "
                "--no-cuda-graphs (cuda_graphs=False) to run them eagerly."
            ) from e
        return graphs

    def _profile_cuda_kv_cache_bytes(self) -> float:
        """Bytes for the KV cache on this GPU, after a forward of the whole token budget:
        --kv-cache-memory where given (checked against what the forward's activations leave
        free), else total memory x utilisation less this engine's peak (its weights and the
        forward; not what other engines in this process held before it loaded)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        engine = self.config.engine
        self._dummy_forward(self._step_tokens_at_most())
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        activations = peak - torch.cuda.memory_allocated(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        requested = engine.cache.kv_cache_memory_bytes
        if requested is not None:
            check_gpu_cache_fits(requested, free - activations, self.device)
            return requested
        return cuda_kv_cache_budget(
            total,
            engine.cache.gpu_memory_utilization,
            peak - self._cuda_held_before,
            free,
            self.device,
        )

    def _longest_prompt(self) -> int:
        """The longest sequence the engine can take: --max-model-len, else the model's
        context (the engine core may fit it shorter, to the cache or a draft model)."""
        engine = self.config.engine
        context = model_max_len(get_arch_config(self.hf_config, engine.model.model_impl))
        return max(1, min(engine.model.max_model_len or context, context))

    def _step_tokens_at_most(self) -> int:
        """The most tokens a step can hold on a GPU: the engine core's budget, fitted for
        the longest sequence it may allow (it may fit max_model_len shorter, to the cache
        or a draft model, once this profile has sized the cache)."""
        scheduler = self.config.engine.scheduler
        return fit_max_num_batched_tokens(
            scheduler.max_num_batched_tokens,
            DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"],
            self._longest_prompt(),
            scheduler.enable_chunked_prefill,
        )

    def _dummy_forward(self, num_tokens: int) -> torch.Tensor:
        """`num_tokens` of prompts through the model over a one-block scratch cache, with the
        logits of every row. Each prompt is at most the model's context long: a position past
        it would index past the model's position tables (on CUDA an illegal memory access
        that poisons the context, or a device-side assert). Under tensor parallelism every
        rank must run it."""
        longest = self._longest_prompt()
        lens = [longest] * (num_tokens // longest) + [num_tokens % longest] * (
            num_tokens % longest > 0
        )
        dummy = self.kv.attach_cache(self.model, 1, self.block_size, self.device)
        layers = attention_layers(self.model)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            block_tables=torch.zeros(
                (len(lens), -(-longest // self.block_size)), dtype=torch.long, device=self.device
            ),
            seq_lens=torch.tensor(lens, device=self.device),
            query_start_loc=torch.tensor([0, *itertools.accumulate(lens)], device=self.device),
            seq_lens_cpu=lens,
            query_lens_cpu=list(lens),
            num_decode_seqs=0,
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        with torch.inference_mode(), forward_context(meta):
            logits = self.model.compute_logits(self.model(ids, positions))
        for layer in layers:
            layer.kv_cache = None
        del dummy
        return logits

    # -- one step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. The driver returns its output; the other ranks None."""
        start = time.perf_counter()
        output = ModelRunnerOutput() if self.step_sampler is not None else None
        forgotten = self.mirror.apply(out)
        if self.draft is not None:
            self.draft.forget(forgotten)
        if self.step_sampler is not None:
            assert output is not None
            self.step_sampler.forget(forgotten)
            assert self.pooler is not None
            self.pooler.forget(forgotten)
            for new in out.new_seqs:
                seq = self.mirror[new.seq_id]
                self.step_sampler.start(seq, new.grammar, output.failed_requests)
        if out.is_empty:
            self._move_blocks(out)
            return output
        self._move_blocks(out)  # before a draft model's forwards, which read the cache
        drafts = (
            before_grammar_start(self.proposer.propose_step(out, self.mirror), self.mirror)
            if self.proposer
            else {}
        )
        inputs = build_model_inputs(out, self.mirror, self.block_size, self.device, drafts)
        prepared = time.perf_counter()
        image_embeddings = None
        if self.images is not None:  # a graph replays token embeddings alone
            image_embeddings = self.images.for_step(inputs.image_spans)
        graph_size = None
        if self.graphs is not None and image_embeddings is None:
            graph_size = self.graphs.size_for(inputs)
        if graph_size is not None:
            assert self.graphs is not None
            hidden = self.graphs.run(inputs, graph_size)
        else:
            adapters = None
            if self.lora is not None:
                adapters, unread = self.lora.batch(inputs.loras, inputs.meta.query_lens_cpu)
                if unread and output is not None:  # those requests fail, the rest run on
                    for s in out.scheduled:
                        seq = self.mirror[s.seq_id]
                        if seq.lora is not None and seq.lora.lora_int_id in unread:
                            message = unread[seq.lora.lora_int_id]
                            output.failed_requests.setdefault(seq.request_id, message)
            images = {} if image_embeddings is None else {"image_embeddings": image_embeddings}
            positions = inputs.positions
            if self.mrope:  # three per token: frame, row, column (Qwen2-VL)
                positions = self.model.multimodal_positions(positions, inputs.mm_rows)
            inputs.meta.output_rows = self._rows_read_alone(inputs)
            with forward_context(inputs.meta), lora_batch(adapters):
                # [num_tokens, hidden], or the output rows' alone
                hidden = self.model(inputs.input_ids, positions, **images)
        logits = None  # [num_sampled, vocab]; None: only prefill-only sequences, none sampled
        if inputs.sampled_seqs:
            narrowed = hidden.shape[0] != inputs.input_ids.shape[0]
            logits = self.model.compute_logits(
                hidden[: inputs.logits_indices.shape[0]]
                if narrowed
                else hidden[inputs.logits_indices]
            )
        prompt_logits = None
        if inputs.prompt_logits_indices is not None:
            prompt_logits = self.model.compute_logits(hidden[inputs.prompt_logits_indices])
        forwarded = time.perf_counter()

        rows = self._sampled_rows(out, inputs.sampled_seqs)
        sampled = [seq for row in rows if not _is_beam(row[0]) for seq in row]
        if self.step_sampler is not None:
            assert output is not None and self.pooler is not None
            # The prompt's rows stay in the model's dtype: token_logprobs converts a few
            # hundred at a time (a whole chunk's in float32 outgrew the profiled memory).
            sampled_logits = None if logits is None else logits.float()
            self.step_sampler.sample(
                sampled_logits,
                rows,
                prompt_logits,
                inputs.prompt_spans,
                output,
                inputs.draft_token_ids,
            )
            if inputs.pool_spans:  # timed with sampling: the driver's work after the forward
                pool_start = time.perf_counter()
                self.pooler.pool(hidden, inputs.pool_spans, output)
                output.sample_s += time.perf_counter() - pool_start
            if self.config.engine.scheduler.scheduling_policy == "sjf":
                last_rows = inputs.logits_indices[inputs.first_logits_rows]
                self._record_prompt_hidden_states(hidden[last_rows], inputs, output)
            output.prepare_s = prepared - start
            output.forward_s = forwarded - prepared
        # Rows each sampled sequence may take: one, or one more than its proposals.
        checking = {
            seq.seq_id: 1 + len(d) for seq, d in zip(inputs.sampled_seqs, inputs.draft_token_ids)
        }
        slots = [(seq.seq_id, checking.get(seq.seq_id, 1)) for seq in sampled]
        self.mirror.append_sampled(*self._share_sampled(output, slots))
        if self.draft is not None:
            self.draft.settle(out, self.mirror)
        return output

    def _rows_read_alone(self, inputs: ModelInputs) -> torch.Tensor | None:
        """The rows the step reads after the model where they are all it reads: a model may
        then return those alone (on CPU, the native layer stack runs its last layer's o_proj
        and MLP for them only: a prompt chunk's other rows need just their K/V), and the
        logits take the first `len(logits_indices)` of them. None where every row is read
        (prompt logprobs, pooling, sjf's prompt states), where nothing is left out, and off
        the CPU. A linear's rows may depend on how many run together under three rows
        (the packed weights' do not from three), so one or two sampled rows (a lone prompt)
        are named with the last repeated up to three, and a step that samples nothing (a long
        prompt's chunks before its last) names its first row three times, for nobody."""
        rows = inputs.logits_indices
        num_rows = max(rows.shape[0], PACKED_MIN_ROWS)
        if (
            self.device.type != "cpu"
            or inputs.prompt_logits_indices is not None
            or inputs.pool_spans
            or self.config.engine.scheduler.scheduling_policy == "sjf"
            or num_rows >= inputs.input_ids.shape[0]
        ):
            return None
        if num_rows > rows.shape[0]:
            last = rows[-1:] if rows.shape[0] else rows.new_zeros(1)
            rows = torch.cat([rows, last.expand(num_rows - rows.shape[0])])
        return rows

    @staticmethod
    def _record_prompt_hidden_states(
        last_hidden: torch.Tensor, inputs: ModelInputs, output: ModelRunnerOutput
    ) -> None:
        """The hidden state at the last prompt token of the sequences sampling their first
        token (recomputes after a preemption have sampled before: not again)."""
        rows = [i for i, seq in enumerate(inputs.sampled_seqs) if seq.num_output_tokens == 0]
        if rows:
            states = last_hidden[rows].float().cpu().tolist()
            for i, state in zip(rows, states):
                output.prompt_hidden_states[inputs.sampled_seqs[i].seq_id] = state

    def _sampled_rows(
        self, out: SchedulerOutput, sampled_seqs: list[MirroredSequence]
    ) -> list[list[MirroredSequence]]:
        """Who samples each logits row: its sequence, and for a first sample of `best_of`
        the forks the scheduler named, made here (sample i draws from seed + i)."""
        forks = {s.seq_id: s.fork_seq_ids for s in out.scheduled if s.fork_seq_ids}
        rows = []
        for seq in sampled_seqs:
            row = [seq]
            seed = seq.sampling_params.seed
            for i, child_id in enumerate(forks.get(seq.seq_id, ()), start=1):
                child = self.mirror.fork_sample(
                    seq.seq_id, child_id, None if seed is None else seed + i
                )
                if self.step_sampler is not None:
                    self.step_sampler.fork(seq, child)
                row.append(child)
            rows.append(row)
        return rows

    def _share_sampled(
        self, output: ModelRunnerOutput | None, slots: list[tuple[int, int]]
    ) -> tuple[list[int], list[int]]:
        """The driver's sampled (seq id, token) rows, on every rank: a broadcast when there
        are several, of each sequence's tokens in `slots` (seq id, most rows), -1 padded
        (a speculating sequence takes a number of tokens only the driver knows)."""
        if self.config.world_size == 1:
            assert output is not None
            return output.seq_ids, output.token_ids
        from serve.distributed.parallel_state import get_tp_group

        total = sum(n for _, n in slots)
        if output is not None:
            taken: dict[int, list[int]] = {}
            for seq_id, token in zip(output.seq_ids, output.token_ids):
                taken.setdefault(seq_id, []).append(token)
            padded = []
            for seq_id, n in slots:
                tokens = taken.get(seq_id, [])
                padded += tokens + [-1] * (n - len(tokens))
            tensor = torch.tensor(padded, dtype=torch.long, device=self.device)
        else:
            tensor = torch.empty(total, dtype=torch.long, device=self.device)
        flat = get_tp_group().broadcast(tensor, src=0).tolist()
        seq_ids, token_ids, i = [], [], 0
        for seq_id, n in slots:
            for token in flat[i : i + n]:
                if token >= 0:
                    seq_ids.append(seq_id)
                    token_ids.append(token)
            i += n
        return seq_ids, token_ids

    def _move_blocks(self, out: SchedulerOutput) -> None:
        """Swap out, swap in, then copy on write, in the target's cache and the draft
        model's: swap-outs read blocks that the scheduler has already handed to others,
        who may overwrite them with the later moves."""
        if not out.has_block_moves:
            return
        assert self.cache_engine is not None
        engines = [self.cache_engine]
        if self.draft is not None:
            assert self.draft.cache_engine is not None
            engines.append(self.draft.cache_engine)
        for engine in engines:
            _move_engine_blocks(engine, out, self.device)


def _is_beam(seq: MirroredSequence) -> bool:
    return seq.sampling_params.use_beam_search


def _move_engine_blocks(engine: CacheEngine, out: SchedulerOutput, device: torch.device) -> None:
    device_caches, swap_caches = engine.kv_caches, engine.swap_caches
    for pairs, src_caches, dst_caches in (
        (out.blocks_to_swap_out, device_caches, swap_caches),
        (out.blocks_to_swap_in, swap_caches, device_caches),
    ):
        if not pairs:
            continue
        src_ids, dst_ids = zip(*pairs)
        for src_kv, dst_kv in zip(src_caches, dst_caches):
            src_index = torch.tensor(src_ids, device=src_kv[0].device)
            dst_index = torch.tensor(dst_ids, device=dst_kv[0].device)
            moves = list(zip(src_kv, dst_kv))
            if src_kv[0] is src_kv[1]:  # the keys are the values: one tensor, moved once
                moves = moves[:1]
            for src, dst in moves:
                swap_blocks(src, dst, src_index, dst_index)
    if out.blocks_to_copy:
        src_ids, dst_ids = zip(*out.blocks_to_copy)
        copy_blocks(
            device_caches,
            torch.tensor(src_ids, device=device),
            torch.tensor(dst_ids, device=device),
        )


def cuda_kv_cache_budget(
    total: int, utilization: float, peak: int, free: int, device: torch.device | str = "cuda"
) -> float:
    """Bytes for the KV cache on a GPU: the engine's share of the device (`total` x
    `utilization`) less the profiled forward's peak, weights included. The cache is
    allocated from what is `free` now: where other processes hold more of the device than
    the share leaves them, this is a start-up error that says what to set, not an
    out-of-memory error halfway through the allocation."""
    budget = total * utilization - peak
    if budget <= free:
        return budget
    # What would fit, a little short of everything free: the graphs and the sampler need some.
    fits = int((free * 0.95 + peak) / total * 100) / 100
    gib = 2**30
    advice = (
        f"Lower --gpu-memory-utilization to {fits:g} or less, or free the GPU."
        if fits * total > peak
        else "Free the GPU."
    )
    raise ValueError(
        f"--gpu-memory-utilization {utilization:g} asks for {total * utilization / gib:.1f} "
        f"GiB of {device}'s {total / gib:.1f} GiB, but only {free / gib:.1f} GiB is free "
        f"beside this engine's peak of {peak / gib:.1f} GiB: other processes hold the rest. "
        + advice
    )
