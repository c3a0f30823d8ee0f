"""POST /v1/embeddings: one pooling request per input, run beside generation requests.

Each input becomes an engine request with `max_tokens` 0 and `pooling` (serve/
pooling_params.py): the engine computes its prompt, samples nothing, and returns the
pooled final hidden state, normalised as the model's pooling says. The inputs run
concurrently, and the response lists their vectors in input order: JSON, or with
encoding_format "bytes"/"bytes_only" (vLLM's) an application/octet-stream body.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import Response

from serve.api.errors import APIError
from serve.api.protocol import response_ids
from serve.api.protocol_embeddings import (
    EmbeddingRequest,
    embedding_bytes,
    embedding_response,
)
from serve.api.request_checks import PromptCharLimit, truncate_prompt
from serve.api.served_models import ServedModels
from serve.api.serving_base import off_the_loop
from serve.api.settings import ServerSettings
from serve.api.streaming import UsageCallback, final_outputs
from serve.engine.protocol import EngineClient
from serve.engine.validation import check_priority
from serve.pooling_params import PoolingParams
from serve.sampling_params import SamplingParams


class EmbeddingHandler:
    def __init__(
        self,
        engine: EngineClient,
        settings: ServerSettings,
        prompt_chars: PromptCharLimit,
        models: ServedModels | None = None,
    ) -> None:
        self.engine, self.settings = engine, settings
        self.tokenizer = engine.tokenizer
        self.prompt_chars = prompt_chars
        self.models = models or ServedModels(settings)

    def params(self, request: EmbeddingRequest) -> SamplingParams:
        """The engine's params for each input; a 400 for what this model cannot do."""
        try:
            params = SamplingParams(
                max_tokens=0, pooling=PoolingParams(dimensions=request.dimensions)
            )
            self.engine.check_params(params)
        except ValueError as e:
            param = "dimensions" if str(e).startswith("dimensions") else None
            raise APIError(400, str(e), param=param) from None
        return params

    def prepare(self, request: EmbeddingRequest) -> list[list[int]]:
        """Each input's token ids, checked: in the vocabulary, not empty, and within the
        context window (an embedding needs no room for output)."""
        try:
            check_priority(request.priority, self.settings.scheduling_policy)
        except ValueError as e:
            raise APIError(400, str(e), param="priority") from None
        max_model_len = self.engine.max_model_len
        prompts = []
        for i, item in enumerate(request.inputs):
            if isinstance(item, str):
                self.prompt_chars.check(item, "input")
                ids = self.tokenizer(item).input_ids
            else:
                try:
                    self.engine.check_token_ids(item, "Input token ids")
                except ValueError as e:
                    raise APIError(400, str(e), param="input") from None
                ids = list(item)
            if not ids:
                raise APIError(400, f"Input {i} has no tokens.", param="input")
            ids = truncate_prompt(
                ids, request.truncate_prompt_tokens, max_model_len, True, is_pooling=True
            )
            if len(ids) > max_model_len:
                raise APIError(
                    400,
                    f"This model's maximum context length is {max_model_len} tokens. However, "
                    f"input {i} has {len(ids)} tokens. Please reduce the length of the input.",
                    param="input",
                    code="context_length_exceeded",
                )
            prompts.append(ids)
        return prompts

    async def create(
        self, request: EmbeddingRequest, on_usage: UsageCallback | None = None
    ) -> dict[str, Any] | Response:
        lora = self.models.resolve(request.model)
        params = self.params(request)
        prompts = await off_the_loop(self.prepare, request)
        request_id, engine_id = response_ids("embd", request.request_id)
        for i, (ids, item) in enumerate(zip(prompts, request.inputs)):
            text = item if isinstance(item, str) else None
            self.settings.request_log.log(f"{engine_id}-{i}", text, ids, params, lora)
        streams = [
            self.engine.generate(
                f"{engine_id}-{i}",
                ids,
                params,
                None,
                self.settings.request_timeout_s,
                priority=request.priority,
                lora_request=lora,
            )
            for i, ids in enumerate(prompts)
        ]
        outs = await final_outputs(streams)
        vectors = []
        for out in outs:
            if out.pooled is None:  # the engine ended it without pooling (an abort)
                raise APIError(500, f"Request {out.request_id} ended without an embedding.")
            vectors.append(out.pooled)
        num_prompt = sum(len(ids) for ids in prompts)
        model = self.models.reply_name(request.model)
        if request.encoding_format in ("bytes", "bytes_only"):
            content, metadata = embedding_bytes(
                request_id, int(time.time()), model, vectors, request, num_prompt
            )
            if on_usage is not None:
                on_usage(metadata["usage"])
            # vLLM's: "bytes" sends the metadata (JSON) in a header, "bytes_only" does not.
            is_bare = request.encoding_format == "bytes_only"
            headers = {} if is_bare else {"metadata": json.dumps(metadata)}
            return Response(content, media_type="application/octet-stream", headers=headers)
        body = {"id": request_id, **embedding_response(model, vectors, request, num_prompt)}
        if on_usage is not None:
            on_usage(body["usage"])
        return body
