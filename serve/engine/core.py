"""EngineCore: the synchronous heart. No asyncio, no HTTP, no text; `step()` runs one
iteration and returns token deltas (scheduler/output_deltas.py) for a front end to decode.

    out    = scheduler.schedule()                    # plain data: SchedulerOutput
    result = executor.execute_model(out)             # plain data: ModelRunnerOutput
    deltas = scheduler.update_from_output(out, result)

The scheduler decides and owns the requests; the executor's workers compute and sample.
Scheduling ahead (`--async-scheduling`) is a loop around that step (`_step_ahead`): while
the workers run step N, a helper thread takes in step N-1's output (handing its deltas
to `deliver` at once, when given) and schedules step N+1; requests that arrive before
step N+1 runs still join it. Requests with a grammar wait here while it compiles (off
the loop), then join the scheduler with the compiled grammar.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from serve.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    EngineConfig,
    fit_max_num_batched_tokens,
)
from serve.engine.lora_check import AdapterChecker
from serve.engine.multimodal import image_layout
from serve.engine.protocol import EngineDeadError
from serve.engine.validation import (
    check_gpu_count,
    check_max_num_batched_tokens,
    check_params,
    check_priority,
    check_token_ids,
    fit_max_model_len,
)
from serve.executor.base import DEFAULT_WORKER_CLASS, Executor
from serve.kv_cache.block_manager import BlockManager
from serve.lora_request import LoRARequest
from serve.models.loader import (
    dtype_name,
    load_hf_config,
    model_max_len,
    resolve_dtype,
    resolve_model_path,
)
from serve.models.partition import check_tensor_parallel
from serve.models.pooling_config import model_pooling
from serve.models.registry import get_arch_config
from serve.models.tokenizer import eos_token_ids, load_tokenizer
from serve.multimodal_inputs import MultiModalInput, check_placements
from serve.outputs import EngineStats, StepTimes, request_error_message
from serve.sampling_params import SamplingParams
from serve.scheduler.output_deltas import RequestDelta
from serve.scheduler.scheduler import Scheduler
from serve.sequence import SequenceGroup
from serve.step import ModelRunnerOutput, SchedulerOutput
from serve.worker.draft_model import draft_max_len
from serve.worker.lazy_structured_output import LazyStructuredOutput
from serve.worker.model_runner import check_cpu_memory_before_loading
from serve.worker.worker import WorkerConfig, resolve_device

if TYPE_CHECKING:
    from serve.worker.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.05  # an idle engine's longest wait on a compiling grammar

_Step = tuple[SchedulerOutput, ModelRunnerOutput]  # a step that has run
Deliver = Callable[[list[RequestDelta]], None]  # takes deltas on the core's helper thread


class EngineCore:
    def __init__(self, config: EngineConfig, worker_class: str = DEFAULT_WORKER_CLASS) -> None:
        self.config = config
        self.model_path = resolve_model_path(config.model.model, config.model.load_format)
        hf_config = load_hf_config(self.model_path)
        tp_size = config.parallel.tensor_parallel_size
        arch = get_arch_config(hf_config, config.model.model_impl)
        check_tensor_parallel(arch, tp_size)  # before any worker starts
        self.tokenizer = load_tokenizer(config.model.tokenizer or self.model_path)
        # None: the model takes no images
        self.image_layout = image_layout(hf_config, self.tokenizer)
        if self.image_layout is not None and config.lora.enable_lora:
            raise ValueError(
                "--enable-lora is not supported with a vision-language model yet "
                f"({self.model_path.name}): serve it without adapters."
            )
        self.eos_token_ids = eos_token_ids(self.model_path, hf_config, self.tokenizer)
        self.vocab_size = arch.vocab_size
        self.pooling = model_pooling(
            self.model_path,
            hf_config,
            arch.hidden_size,
            config.model.pooling_type,
            config.model.pooling_normalize,
        )
        device = resolve_device(config.device)
        device_type = device.type
        if device_type == "cuda" and config.parallel.executor_backend != "ray":
            import torch

            check_gpu_count(tp_size, torch.cuda.device_count())
        if device_type == "cpu":
            check_cpu_memory_before_loading(config, self.model_path, hf_config)
        # A draft model's context bounds max_model_len too; read before any model loads.
        spec = config.speculative.method
        draft_limit = draft_max_len(spec, config.model) if spec is not None and spec.model else None
        worker_config = WorkerConfig(
            config, str(self.model_path), tuple(sorted(self.eos_token_ids)), world_size=tp_size
        )
        self.executor = Executor.create(worker_config, worker_class)
        try:
            block_size = config.cache.block_size
            num_blocks = self.executor.num_blocks
            self.max_model_len = fit_max_model_len(
                config.model.max_model_len,
                model_max_len(arch),
                num_blocks * block_size,
                draft_limit,
            )
            self.max_num_batched_tokens = fit_max_num_batched_tokens(
                config.scheduler.max_num_batched_tokens,
                DEFAULT_MAX_NUM_BATCHED_TOKENS[device_type],
                self.max_model_len,
                config.scheduler.enable_chunked_prefill,
            )
            check_max_num_batched_tokens(
                self.max_num_batched_tokens,
                self.max_model_len,
                config.scheduler.enable_chunked_prefill,
            )
            self.block_manager = BlockManager(
                num_blocks,
                block_size,
                self.executor.num_cpu_blocks,
                config.cache.enable_prefix_caching,
                # Runs pay where the CPU's prefetchers read K/V; a GPU's attention does not
                # notice, and finding a run costs a scan of the pool per new sequence.
                place_in_runs=device_type == "cpu",
            )
        except BaseException:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(
            config.scheduler,
            self.max_num_batched_tokens,
            self.max_model_len,
            self.block_manager,
            self.eos_token_ids,
            speculation=config.speculative.method,
            max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
        )
        self.adapters = AdapterChecker(config, lambda: hf_config)
        self._grammars = LazyStructuredOutput(
            lambda: self.tokenizer, self.vocab_size, self.eos_token_ids
        )
        self._compiling: dict[str, concurrent.futures.Future[str]] = {}  # request id -> grammar
        self.step_times = StepTimes()
        self.async_scheduling = config.scheduler.async_scheduling
        self._in_flight: _Step | None = None  # has run; its output not yet taken in
        self._ahead: SchedulerOutput | None = None  # scheduled while the last step ran
        self._helper = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine-helper"
        )
        self.is_shut_down = False
        model_dtype = dtype_name(resolve_dtype(config.model.dtype, hf_config, device, log=False))
        logger.info(
            "Model %s (%s) in %s on %s, tensor parallel size %d (%s); KV cache (%s): %d blocks x "
            "%d tokens = %d tokens, swap space %d blocks; prefix caching %s; max_model_len %d",
            self.model_path,
            ",".join(getattr(hf_config, "architectures", None) or ["?"]),
            model_dtype,
            device_type,
            tp_size,
            config.parallel.executor_backend,
            model_dtype if config.cache.kv_cache_dtype == "auto" else config.cache.kv_cache_dtype,
            num_blocks,
            block_size,
            num_blocks * block_size,
            self.executor.num_cpu_blocks,
            "on" if config.cache.enable_prefix_caching else "off",
            self.max_model_len,
        )
        logger.info(
            "Embeddings pool by %s%s%s",
            self.pooling.pooling_type,
            ", L2-normalised" if self.pooling.normalize else "",
            ", Matryoshka dimensions allowed" if self.pooling.supports_dimensions else "",
        )

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        mm_inputs: tuple[MultiModalInput, ...] = (),
    ) -> None:
        """Queue a request (ValueError if it is invalid). One with a grammar joins the
        scheduler's queue once its grammar has compiled. `mm_inputs`: its prompt's images,
        processed (`engine/multimodal.py`)."""
        if self.is_shut_down:
            raise EngineDeadError(
                "The engine was shut down, its model and KV cache freed: start a new one "
                "(a new LLM) to run more requests."
            )
        self.check_token_ids(prompt_token_ids, "Prompt token ids")
        self.check_params(params)
        self.adapters.check(lora_request)
        if mm_inputs:
            self.check_mm_inputs(mm_inputs, prompt_token_ids, params)
        if params.pooling is not None:  # the model's defaults, so the workers read them
            params = replace(params, pooling=self.pooling.resolve(params.pooling))
        check_priority(priority, self.config.scheduler.scheduling_policy)
        # Everything that can fail comes before the request is registered anywhere, so a
        # failure leaves no trace of it.
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured_output.submit(params.structured_outputs)
        self.scheduler.add_request(
            request_id,
            prompt_token_ids,
            params,
            prompt,
            awaits_grammar=grammar is not None,
            priority=priority,
            lora=lora_request,
            mm_inputs=mm_inputs,
        )
        if grammar is not None:
            self._compiling[request_id] = grammar

    def check_token_ids(self, token_ids: list[int], what: str = "Token ids") -> None:
        check_token_ids(token_ids, self.vocab_size, what)

    def check_mm_inputs(
        self,
        mm_inputs: tuple[MultiModalInput, ...],
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        """A request's images: the model takes them, and each run of placeholder tokens
        is where its image says, of the length its embeddings take."""
        layout = self.image_layout
        if layout is None:
            raise ValueError(f"{self.model_path.name} takes no images: send text alone.")
        check_placements(list(mm_inputs), len(prompt_token_ids))
        for item in mm_inputs:
            if item.modality != "image" or "pixel_values" not in item.tensors:
                raise ValueError(f"{item.modality} input without pixel_values is not taken.")
            run = prompt_token_ids[item.offset : item.end]
            arrays = {name: array.numpy() for name, array in item.tensors.items()}
            expected = layout.run_tokens(arrays)
            takes = [t == layout.placeholder_token_id for t in expected]
            given = [True] * item.length if item.is_embed is None else item.is_embed.numpy()
            if run != expected or list(given) != takes:
                raise ValueError(
                    f"An image's run [{item.offset}, {item.end}) must be its "
                    f"{len(expected)} placeholder tokens ({layout.placeholder_token_id}, and "
                    "any row tokens); MultiModalProcessor.process makes it."
                )

    def check_params(self, params: SamplingParams) -> None:
        params.update_from_tokenizer(self.tokenizer, self.vocab_size)  # bad words, for the check
        check_params(
            params,
            self.vocab_size,
            self.config.model.max_logprobs,
            self.pooling,
            self.eos_token_ids,
        )

    @property
    def structured_output(self) -> StructuredOutputManager:
        """Compiles grammars (the workers match them)."""
        return self._grammars.get()

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """End a request and free its blocks; its final message (None: no such request)."""
        self._compiling.pop(request_id, None)
        return self.scheduler.abort_request(request_id)

    def stop_sequence(self, request_id: str, index: int) -> RequestDelta | None:
        """Finish sequence `index` of a request, whose text the front end found to reach a
        stop string; its siblings run on. Its final message when the request ends."""
        return self.scheduler.stop_sequence(request_id, index)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self._in_flight is not None
            or self._ahead is not None
        )

    @property
    def num_generated_tokens(self) -> int:
        """Tokens given to sequences since start (beams included; none dropped after a stop)."""
        return self.scheduler.num_generated_tokens

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_blocks_total=bm.num_blocks,
            num_blocks_used=bm.block_pool.num_used_blocks,
            num_blocks_cached=bm.block_pool.num_cached_blocks,
            peak_num_blocks_used=bm.block_pool.peak_num_used,
            prefix_cache_queries=bm.prefix_cache.queries,
            prefix_cache_hits=bm.prefix_cache.hits,
            num_preemptions=sched.num_preemptions,
            kv_waste_fraction=bm.kv_waste_fraction(),
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + len(sched.awaiting_grammar),
            num_waiting_for_grammar=len(sched.awaiting_grammar),
            num_swapped=len(sched.swapped),
            num_cpu_blocks_used=bm.cpu_pool.num_used_blocks,
            num_cpu_blocks_total=bm.cpu_pool.num_blocks,
            queue_times=sched.queue_times.copy(),
            iteration_tokens=sched.iteration_tokens.copy(),
            sjf_predictor_mae_tokens=sched.policy.predictor_error,
            sjf_longest_passed_over_s=sched.policy.longest_passed_over_s,
            spec_decode=None if sched.spec_decode is None else sched.spec_decode.copy(),
            running_lora_adapters=_adapter_counts(sched.running),
            waiting_lora_adapters=_adapter_counts(
                [*sched.waiting, *sched.awaiting_grammar.values(), *sched.swapped]
            ),
        )

    def reset_peak(self) -> None:
        self.block_manager.block_pool.reset_peak()

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes; False while a request holds blocks (nothing is
        forgotten then), as vLLM's."""
        return self.block_manager.block_pool.reset_prefix_cache()

    def check_health(self) -> None:
        """Raise if a worker has died (an idle engine's loop asks now and then)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the workers (an in-process one frees the model and the KV cache); requests
        are refused from now on. Idempotent."""
        self.is_shut_down = True
        self._helper.shutdown(wait=True)
        self.scheduler.policy.close()
        self.executor.shutdown()
        self._grammars.close()

    # -- the step ------------------------------------------------------------------------

    def step(self, deliver: Deliver | None = None) -> list[RequestDelta]:
        """One iteration; returns the new tokens of the requests that made progress.

        Without async scheduling, each call runs one step start to end. With it (the
        default), the call that runs step N takes in step N-1's output: a helper thread
        does that and schedules step N+1 while the workers run step N here. Step N-1's
        deltas go to `deliver` from the helper thread as soon as they exist (so a client
        sees a token a step sooner); without `deliver` this call returns them. Waiting
        requests that arrived since step N was scheduled are admitted into it first, within
        the budget it left (`Scheduler.admit_arrivals`).

        Step N+1 counts the tokens step N samples before they exist (the workers fill them
        in). So a sequence whose token from step N stops it (EOS, a stop token) may be in
        step N+1 too, computing a token that is dropped; one that step N ends by its length
        is not. A step whose sampling forks sequences (beam search, the first sample of
        `best_of`), or speculates (how many tokens each sequence takes is known only after
        it), is not scheduled past. The tokens are the same either way.

        The forward stays on the calling thread: on CPU, glibc reuses freed activations
        only in the main thread's heap (a worker thread's arena maps large tensors afresh
        each step, ~20% slower prefill)."""
        if self.async_scheduling:
            return self._step_ahead(deliver)
        out = self._schedule(wait_for_grammar=True)
        return self._update(out, self._execute(out))

    def _step_ahead(self, deliver: Deliver | None) -> list[RequestDelta]:
        deltas: list[RequestDelta] = []
        out, self._ahead = self._ahead, None
        if out is None:  # not scheduled ahead: just started, or the step before forks or speculates
            deltas += self._settle_in_flight()
            out = self._schedule(wait_for_grammar=True)
        else:
            self._admit_arrivals(out)
        if not out.has_worker_work:
            deltas += self._settle_in_flight()
            return deltas + self._update(out, ModelRunnerOutput())
        previous, self._in_flight = self._in_flight, None
        helper = self._helper.submit(self._beside_forward, previous, out, deliver)
        try:
            result = self._execute(out)
        finally:
            taken_in, self._ahead = helper.result()  # never leave the helper running
        self._in_flight = (out, result)
        return deltas + taken_in

    def _admit_arrivals(self, ahead: SchedulerOutput) -> None:
        start = time.perf_counter()
        self._admit_compiled()
        self.scheduler.admit_arrivals(ahead)
        self.step_times.schedule_s += time.perf_counter() - start

    def _beside_forward(
        self, previous: _Step | None, running: SchedulerOutput, deliver: Deliver | None
    ) -> tuple[list[RequestDelta], SchedulerOutput | None]:
        """The helper thread's work while `running` runs: the step before's output taken
        in (its deltas handed to `deliver` at once, if given, else returned), then the next
        step scheduled (None: it waits for `running`'s output, whose forks or accepted
        proposals it depends on)."""
        start = time.perf_counter()
        deltas = [] if previous is None else self._update(*previous)
        if deliver is not None and deltas:
            deliver(deltas)
            deltas = []
        ahead = None
        if not running.next_waits_for_output:
            ahead = self._schedule(wait_for_grammar=False)
            self.step_times.num_steps_ahead += ahead.has_worker_work
        self.step_times.overlapped_s += time.perf_counter() - start
        return deltas, ahead

    def _settle_in_flight(self) -> list[RequestDelta]:
        if self._in_flight is None:
            return []
        previous, self._in_flight = self._in_flight, None
        return self._update(*previous)

    def _schedule(self, wait_for_grammar: bool) -> SchedulerOutput:
        """The next step. With nothing to run but grammars compiling, `wait_for_grammar`
        waits a little for one instead of returning at once (a busy spin)."""
        start = time.perf_counter()
        self._admit_compiled()
        out = self.scheduler.schedule()
        self.step_times.schedule_s += time.perf_counter() - start
        if wait_for_grammar and not out.has_worker_work and self._compiling:
            concurrent.futures.wait(
                self._compiling.values(),
                timeout=GRAMMAR_POLL_S,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
        return out

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if not out.has_worker_work:
            return ModelRunnerOutput()
        result = self.executor.execute_model(out)
        times = self.step_times
        times.num_steps += 1
        times.prepare_s += result.prepare_s
        times.forward_s += result.forward_s
        times.sample_s += result.sample_s
        return result

    def _update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestDelta]:
        start = time.perf_counter()
        deltas = self.scheduler.update_from_output(out, result)
        self.step_times.output_s += time.perf_counter() - start
        return deltas

    def _admit_compiled(self) -> None:
        """Hand requests whose grammar has compiled to the scheduler; end those whose
        grammar failed (the API compiles first and answers 400, so only direct users of
        the engine get here)."""
        for request_id, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                self.scheduler.set_grammar(request_id, future.result())
            except Exception as e:
                logger.warning("Request %s: its grammar failed: %s", request_id, e)
                self.scheduler.fail_request(request_id, request_error_message(e))


def _adapter_counts(groups: Iterable[SequenceGroup]) -> dict[str, int]:
    """Requests per LoRA adapter name among `groups`."""
    counts: dict[str, int] = {}
    for group in groups:
        if group.lora is not None:
            counts[group.lora.lora_name] = counts.get(group.lora.lora_name, 0) + 1
    return counts
