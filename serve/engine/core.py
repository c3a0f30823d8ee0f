"""EngineCore: the synchronous heart. No asyncio, no HTTP; `step()` runs one iteration."""

from __future__ import annotations

import logging

import torch

from serve.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from serve.engine.detokenizer import Detokenizer, find_stop_string
from serve.engine.model_runner import ModelRunner
from serve.engine.sampler import Sampler, SamplerOutput
from serve.engine.tokenizer import eos_token_ids, load_tokenizer
from serve.kv_cache.block_manager import BlockManager
from serve.models.loader import load_hf_config, model_max_len, resolve_model_path
from serve.outputs import CompletionOutput, RequestOutput
from serve.sampling_params import SamplingParams
from serve.scheduler.scheduler import Scheduler
from serve.sequence import FinishReason, Sequence

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available here.")
    return torch.device(device)


def fit_max_model_len(requested: int | None, model_limit: int, cache_tokens: int) -> int:
    """The context window the engine can honour: the user's, or the model's fitted to the cache."""
    if requested is not None:
        if requested > model_limit:
            raise ValueError(
                f"max_model_len={requested} is longer than this model supports ({model_limit}, "
                "its max_position_embeddings or sliding window). Lower --max-model-len."
            )
        if requested > cache_tokens:
            raise ValueError(
                f"The KV cache holds {cache_tokens} tokens, fewer than one sequence of "
                f"max_model_len={requested}. Lower --max-model-len to at most {cache_tokens}, "
                "or raise --kv-cache-memory (CPU) / --gpu-memory-utilization (GPU)."
            )
        return requested
    if model_limit > cache_tokens:
        logger.warning(
            "The KV cache holds %d tokens, fewer than the model's context of %d: "
            "max_model_len is set to %d. Raise the KV cache memory for longer contexts.",
            cache_tokens,
            model_limit,
            cache_tokens,
        )
        return cache_tokens
    return model_limit


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.model_path = resolve_model_path(config.model.model, config.model.load_format)
        hf_config = load_hf_config(self.model_path)
        self.tokenizer = load_tokenizer(config.model.tokenizer or self.model_path)
        self.eos_token_ids = eos_token_ids(self.model_path, hf_config, self.tokenizer)
        self.vocab_size = int(hf_config.vocab_size)
        self.model_runner = ModelRunner(config, self.model_path, hf_config, self.device)

        block_size = config.cache.block_size
        num_blocks = self.model_runner.num_blocks
        self.max_model_len = fit_max_model_len(
            config.model.max_model_len, model_max_len(hf_config), num_blocks * block_size
        )
        self.max_num_batched_tokens = (
            config.scheduler.max_num_batched_tokens
            or DEFAULT_MAX_NUM_BATCHED_TOKENS[self.device.type]
        )
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(
            config.scheduler, self.max_num_batched_tokens, self.max_model_len, self.block_manager
        )
        self.sampler = Sampler(config.model.seed)
        self.detokenizer = Detokenizer(self.tokenizer)
        self._seqs: dict[str, Sequence] = {}
        self._next_seq_id = 0
        logger.info(
            "Model %s (%s) on %s in %s; KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB); "
            "max_model_len %d",
            self.model_path,
            ",".join(getattr(hf_config, "architectures", None) or ["?"]),
            self.device,
            str(self.model_runner.dtype).removeprefix("torch."),
            num_blocks,
            block_size,
            num_blocks * block_size,
            num_blocks * self.model_runner.bytes_per_block / 2**30,
            self.max_model_len,
        )

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> None:
        if request_id in self._seqs:
            raise ValueError(f"A request with id {request_id!r} is already running.")
        self.check_token_ids(prompt_token_ids, "Prompt token ids")
        seq = Sequence(self._next_seq_id, request_id, prompt_token_ids, params, prompt)
        self.scheduler.add(seq)  # validates the prompt length
        self._next_seq_id += 1
        self.detokenizer.start(seq)
        self._seqs[request_id] = seq

    def check_token_ids(self, token_ids: list[int], what: str = "Token ids") -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} must be in [0, {self.vocab_size}); got {bad[:5]}.")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = FinishReason.ABORT
        self._finish(seq)
        return self._output(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._seqs)

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the batch, sample, update. Returns the requests that
        produced a token this step (cumulative outputs)."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        model_out = self.model_runner.execute(sched)
        sampled = self.sampler(model_out.logits, model_out.sampled_seqs)
        self.scheduler.update(sched)
        return self._update(model_out.sampled_seqs, sampled)

    def _update(self, seqs: list[Sequence], sampled: SamplerOutput) -> list[RequestOutput]:
        outputs = []
        for i, seq in enumerate(seqs):
            token = sampled.token_ids[i]
            seq.append_token(token, sampled.logprobs[i], sampled.top_logprobs[i])
            delta = self.detokenizer.update(seq)
            seq.finish_reason = self._check_stop(seq, token, len(delta))
            if seq.finish_reason is not None:
                self._finish(seq)
            outputs.append(self._output(seq))
        return outputs

    def _check_stop(self, seq: Sequence, token: int, num_new_chars: int) -> FinishReason | None:
        params = seq.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return FinishReason.STOP
        if find_stop_string(seq, num_new_chars):
            return FinishReason.STOP
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.sampler.free(seq.seq_id)
        del self._seqs[seq.request_id]

    @staticmethod
    def _output(seq: Sequence) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=seq.output_text,
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(seq.output_top_logprobs)
            if seq.sampling_params.logprobs is not None
            else None,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput(
            seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], seq.is_finished
        )
