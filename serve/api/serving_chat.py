"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from serve.api.errors import APIError
from serve.api.protocol import ChatCompletionRequest, now, random_id
from serve.api.serving_base import (
    ChunkWriter,
    ServerSettings,
    UsageCallback,
    check_model,
    final_choices,
    open_stream,
    ranked_alternatives,
    resolve_max_tokens,
    stream_choices,
    token_text,
    usage,
)
from serve.engine.async_engine import AsyncEngine
from serve.outputs import CompletionOutput, RequestOutput


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    chat_template: str | None,
) -> tuple[str, list[int]]:
    """The prompt text and ids for a conversation, through the tokenizer's chat template."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400,
            "This model has no chat template, so chat completions cannot be rendered. Start "
            "the server with --chat-template FILE (a Jinja template), or use /v1/completions.",
        )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except Exception as e:  # a template may raise on roles it does not support
        raise APIError(400, f"The chat template cannot render these messages: {e}") from None
    return text, tokenizer(text, add_special_tokens=False).input_ids


class ChatHandler:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine, self.settings = engine, settings
        self.tokenizer = engine.tokenizer

    def prepare(self, request: ChatCompletionRequest) -> tuple[str, list[int], int]:
        check_model(request.model, self.settings)
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        template = request.chat_template or self.settings.chat_template
        text, prompt_ids = render_chat(
            self.tokenizer, messages, request.add_generation_prompt, template
        )
        max_tokens = resolve_max_tokens(
            len(prompt_ids), request.requested_max_tokens, self.engine.max_model_len
        )
        return text, prompt_ids, max_tokens

    def _logprobs(self, completion: CompletionOutput, start: int, end: int, num_top: int):
        if completion.logprobs is None:
            return None
        content = []
        for token_id, top in zip(completion.token_ids[start:end], completion.logprobs[start:end]):
            token = token_text(self.tokenizer, token_id)
            ranked = ranked_alternatives(top, num_top)
            content.append(
                {
                    "token": token,
                    "logprob": top[token_id],
                    "bytes": list(token.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": (t := token_text(self.tokenizer, tid)),
                            "logprob": lp,
                            "bytes": list(t.encode("utf-8")),
                        }
                        for tid, lp in ranked
                    ],
                }
            )
        return {"content": content}

    async def create(self, request: ChatCompletionRequest) -> dict[str, Any]:
        text, prompt_ids, max_tokens = self.prepare(request)
        request_id = random_id("chatcmpl")
        stream = open_stream(
            self.engine, request, request_id, prompt_ids, text, max_tokens, request.num_logprobs
        )
        finals = await final_choices([stream], request.n)
        choices = []
        for index, completion in enumerate(finals):
            choices.append(
                {
                    "index": index,
                    "message": {"role": "assistant", "content": completion.text},
                    "logprobs": self._logprobs(
                        completion, 0, len(completion.token_ids), request.top_logprobs or 0
                    ),
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                }
            )
        num_completion = sum(len(c.token_ids) for c in finals)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": now(),
            "model": self.settings.served_model_name,
            "choices": choices,
            "usage": usage(len(prompt_ids), num_completion),
        }

    def stream(
        self, request: ChatCompletionRequest, on_usage: UsageCallback | None = None
    ) -> AsyncIterator[str]:
        """SSE chunks as OpenAI sends them: a role chunk per choice, content deltas, a finish
        chunk per choice, the usage chunk if asked for, then [DONE]. Bad requests raise here,
        before the response starts."""
        text, prompt_ids, max_tokens = self.prepare(request)
        writer = ChunkWriter(
            random_id("chatcmpl"),
            "chat.completion.chunk",
            self.settings.served_model_name,
            bool(request.stream_options and request.stream_options.include_usage),
        )
        stream = open_stream(
            self.engine, request, writer.id, prompt_ids, text, max_tokens, request.num_logprobs
        )
        return self._events(request, [stream], writer, len(prompt_ids), on_usage)

    async def _events(
        self,
        request: ChatCompletionRequest,
        streams: list[AsyncIterator[RequestOutput]],
        writer: ChunkWriter,
        num_prompt_tokens: int,
        on_usage: UsageCallback | None,
    ) -> AsyncIterator[str]:
        for index in range(request.n):
            role = {"role": "assistant", "content": ""}
            yield writer.chunk(index, delta=role, logprobs=None, finish_reason=None)
        num_top = request.top_logprobs or 0

        def content(index, completion, text, start, end, sent_chars):
            logprobs = self._logprobs(completion, start, end, num_top)
            return {"delta": {"content": text}, "logprobs": logprobs}

        async for event in stream_choices(
            streams,
            request.n,
            writer,
            request.stop,
            num_prompt_tokens,
            content,
            {"delta": {}},
            on_usage,
        ):
            yield event
