"""POST /v1/completions.

`max_tokens` 0 with `echo` scores the prompt, as OpenAI's legacy API did (lm-evaluation-
harness asks for it with `logprobs`): a prefill-only engine request, which samples
nothing and ends once its prompt is computed. Each choice's text is the prompt, its
logprobs the prompt tokens' (the first's null), its finish reason "length", and no
completion token is counted. Streamed, each choice is one chunk with all of that."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from serve.api.errors import APIError
from serve.api.logprobs_json import prompt_logprobs_json, ranked_alternatives, token_label
from serve.api.protocol import CompletionRequest, now, response_ids
from serve.api.request_checks import (
    PromptCharLimit,
    check_limits,
    check_no_streamed_prompt_logprobs,
    fit_prompt,
    grammar_start,
)
from serve.api.served_models import ServedModels
from serve.api.serving_base import off_the_loop, open_stream
from serve.api.settings import ServerSettings
from serve.api.sse import ChunkWriter
from serve.api.streaming import (
    StreamState,
    UsageCallback,
    final_outputs,
    finish_chunk,
    guard_stream,
    merge_streams,
    stream_choices,
    stream_end,
    usage,
)
from serve.chat.reasoning_parsers import reasoning_parser_for
from serve.engine.detokenizer import MAX_CHAR_TOKENS
from serve.engine.protocol import EngineClient
from serve.lora_request import LoRARequest
from serve.outputs import CompletionOutput, OutputKind, RequestOutput


class CompletionHandler:
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
        # vLLM's engine holds a completion's grammar back until the reasoning ends too.
        name = settings.reasoning_parser
        self.reasoning_parser = reasoning_parser_for(name, self.tokenizer) if name else None

    def _prompts(self, request: CompletionRequest) -> list[tuple[str, list[int]]]:
        """(text, token ids) per prompt: a string, strings, token ids, or lists of ids."""
        raw = request.prompt
        if isinstance(raw, str):
            raw = [raw]
        elif raw and isinstance(raw[0], int):
            raw = [raw]
        prompts = []
        for item in raw:
            if isinstance(item, str):
                self.prompt_chars.check(item, "prompt")
                ids = self.tokenizer(item).input_ids
                prompts.append((item, ids))
                continue
            if not item:
                raise APIError(400, "A prompt of token ids must not be empty.", param="prompt")
            try:
                self.engine.check_token_ids(item, "Prompt token ids")
            except ValueError as e:
                raise APIError(400, str(e), param="prompt") from None
            prompts.append((self.tokenizer.decode(item), list(item)))
        if any(not ids for _, ids in prompts):
            raise APIError(400, "The prompt is empty.", param="prompt")
        return prompts

    def prepare(self, request: CompletionRequest) -> list[tuple[str, list[int], int]]:
        check_limits(request, self.settings)
        if request.suffix:
            raise APIError(400, "suffix is not supported by this model.", param="suffix")
        if request.requested_max_tokens == 0 and not request.echo:
            raise APIError(
                400,
                "max_tokens is 0, which generates nothing: set echo to true to score the "
                "prompt (its logprobs with logprobs), or ask for at least 1 token.",
                param="max_tokens",
            )
        if request.stream and request.requested_max_tokens != 0:
            check_no_streamed_prompt_logprobs(request)
        return [
            fit_prompt(text, ids, request, self.tokenizer, self.engine.max_model_len, self.settings)
            for text, ids in self._prompts(request)
        ]

    def _open(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts,
        lora: LoRARequest | None,
        output_kind: OutputKind = OutputKind.DELTA,
    ):
        """One engine request per prompt, with the adapter `lora` (None: the base model):
        deltas to stream, or the final output."""
        return [
            open_stream(
                self.engine,
                self.settings,
                request,
                f"{request_id}-{i}",
                ids,
                text,
                max_tokens,
                request.num_logprobs,
                output_kind,
                grammar_start_token_ids=self._grammar_start(request, ids),
                lora_request=lora,
            )
            for i, (text, ids, max_tokens) in enumerate(prompts)
        ]

    def _grammar_start(self, request: CompletionRequest, prompt_ids: list[int]) -> tuple[int, ...]:
        """Where the prompt's grammar starts: with --reasoning-parser, after the reasoning
        unless the prompt ended it (read as vLLM's engine does: no template variables)."""
        if self.reasoning_parser is None:
            return ()
        return grammar_start(self.reasoning_parser.for_request(prompt_ids, {}), request)

    def _logprobs(
        self,
        completion: CompletionOutput,
        text_offset: int,
        num_top: int,
        as_ids: bool,
        context: list[int],
    ) -> dict[str, Any] | None:
        """The logprobs of the output's tokens (a DELTA output's: the new ones), their text
        starting at `text_offset`, after the sequence's tokens `context`."""
        if completion.logprobs is None:
            return None
        return self._token_logprobs(
            completion.token_ids, completion.logprobs, text_offset, num_top, as_ids, context
        )

    def _token_logprobs(
        self,
        token_ids: list[int],
        logprobs: list[dict[int, float] | None],
        text_offset: int,
        num_top: int,
        as_ids: bool,
        context: list[int],
    ) -> dict[str, Any]:
        """The legacy completions shape; a position with no logprobs (the first prompt
        token, under echo) has null ones. Tokens are labelled after the ones before them
        (`context`, then these), so the labels of a character split over several tokens
        join to it and text_offset counts the text the response has."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        context = context[-MAX_CHAR_TOKENS:]
        for token_id, top in zip(token_ids, logprobs):
            before, context = context, [*context[1 - MAX_CHAR_TOKENS :], token_id]
            token = token_label(self.tokenizer, token_id, as_ids, before)
            tokens.append(token)
            offsets.append(text_offset)
            text_offset += len(token)
            if top is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(top[token_id])
            # The chosen token and the `num_top` best, as OpenAI's legacy API and vLLM give
            # them (up to logprobs + 1 entries). Keyed by text: ids that decode alike (e.g.
            # partial UTF-8, "\ufffd") share a key, which keeps the chosen token's logprob,
            # else the best (`ranked` is sorted best first).
            by_text: dict[str, float] = {token: top[token_id]}
            for t, lp in ranked_alternatives(top, num_top):
                by_text.setdefault(token_label(self.tokenizer, t, as_ids, before), lp)
            top_logprobs.append(by_text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def _choice(
        self, request: CompletionRequest, index: int, prompt_text: str, out: RequestOutput
    ) -> dict[str, Any]:
        completion = out.outputs[index % request.n]
        prefix = prompt_text if request.echo else ""
        num_top = request.logprobs or 0
        as_ids = request.tokens_as_ids(self.settings.return_tokens_as_token_ids)
        # Under echo with logprobs the prompt's come first (echo asks the engine for them:
        # `num_prompt_logprobs`), and the output's text_offset starts past their labels.
        echoed, start = None, 0
        if request.echo and completion.logprobs is not None and out.prompt_logprobs is not None:
            prompt = (out.prompt_token_ids, out.prompt_logprobs)
            echoed = self._token_logprobs(*prompt, 0, num_top, as_ids, [])
            start = sum(len(token) for token in echoed["tokens"])
        logprobs = self._logprobs(completion, start, num_top, as_ids, out.prompt_token_ids)
        if echoed is not None and logprobs is not None:
            logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
        choice = {
            "index": index,
            "text": prefix + completion.text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        if request.return_token_ids:
            choice["prompt_token_ids"] = out.prompt_token_ids
            choice["token_ids"] = completion.token_ids
        if request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(
                self.tokenizer, out, request.prompt_logprobs
            )
        return choice

    async def create(
        self, request: CompletionRequest, on_usage: UsageCallback | None = None
    ) -> dict[str, Any]:
        lora = self.models.resolve(request.model)
        prompts = await off_the_loop(self.prepare, request)
        request_id, engine_id = response_ids("cmpl", request.request_id)
        outs = await final_outputs(
            self._open(request, engine_id, prompts, lora, OutputKind.FINAL_ONLY)
        )
        choices = []
        for i, out in enumerate(outs):
            out.outputs.sort(key=lambda c: c.index)
            for j in range(request.n):
                choices.append(self._choice(request, i * request.n + j, prompts[i][0], out))
        cached = sum(out.num_cached_tokens or 0 for out in outs)
        counts = usage(
            sum(len(ids) for _, ids, _ in prompts),
            sum(out.num_output_tokens for out in outs),
            cached if self.settings.prompt_tokens_details else None,
        )
        if on_usage is not None:
            on_usage(counts)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": now(),
            "model": self.models.reply_name(request.model),
            "choices": choices,
            "usage": counts,
        }

    async def stream(
        self, request: CompletionRequest, on_usage: UsageCallback | None = None
    ) -> AsyncIterator[bytes]:
        lora = self.models.resolve(request.model)
        prompts = await off_the_loop(self.prepare, request)
        response_id, engine_id = response_ids("cmpl", request.request_id)
        writer = ChunkWriter(
            response_id,
            "text_completion",
            self.models.reply_name(request.model),
            *request.usage_in_stream(self.settings.force_include_usage),
            num_prompt_tokens=tuple(len(ids) for _, ids, _ in prompts),
            n=request.n,
            prompt_token_ids=tuple(ids for _, ids, _ in prompts)
            if request.return_token_ids
            else None,
        )
        if request.requested_max_tokens == 0:  # one chunk per choice, at its end
            streams = self._open(request, engine_id, prompts, lora, OutputKind.FINAL_ONLY)
            return self._prompt_score_events(request, prompts, streams, writer, on_usage)
        streams = self._open(request, engine_id, prompts, lora)
        return self._events(request, prompts, streams, writer, on_usage)

    async def _prompt_score_events(
        self,
        request: CompletionRequest,
        prompts: list[tuple[str, list[int], int]],
        streams: list[AsyncIterator[RequestOutput]],
        writer: ChunkWriter,
        on_usage: UsageCallback | None,
    ) -> AsyncIterator[bytes]:
        """max_tokens 0 with echo, streamed: one chunk per choice, once its prompt is
        computed, with the prompt's text, logprobs and finish reason."""
        async with guard_stream() as failed:
            async for index, out in merge_streams(streams):
                if out.finished:
                    choice = self._choice(request, index, prompts[index][0], out)
                    del choice["index"]
                    yield writer.chunk(index, **choice)
        counts = usage(sum(len(ids) for _, ids, _ in prompts), 0)
        for event in stream_end(writer, failed, counts, on_usage):
            yield event

    async def _events(
        self,
        request: CompletionRequest,
        prompts: list[tuple[str, list[int], int]],
        streams: list[AsyncIterator[RequestOutput]],
        writer: ChunkWriter,
        on_usage: UsageCallback | None,
    ) -> AsyncIterator[bytes]:
        num_choices = len(streams) * request.n
        # Echo without logprobs goes first, alone. With logprobs it waits for the prompt's
        # (they come with each request's first output) and leads the choice's first chunk,
        # as vLLM streams it: the prompt's text and tokens, then the output's first.
        echo_waits = request.echo and request.logprobs is not None
        if request.echo and not echo_waits:
            for index in range(num_choices):
                echo = prompts[index // request.n][0]
                yield writer.chunk(index, text=echo, logprobs=None, finish_reason=None)
        state = StreamState(num_choices)  # its prompt_outputs hold the prompts' logprobs
        unechoed = set(range(num_choices)) if echo_waits else set()
        num_top = request.logprobs or 0
        as_ids = request.tokens_as_ids(self.settings.return_tokens_as_token_ids)
        # Each choice's next text_offset: counted by the tokens' texts, as the whole
        # response counts them, not by the text sent (the detokenizer and stop strings
        # hold some back for a while).
        offsets = [0] * num_choices
        # Each choice's last tokens, which label the next ones (`_token_logprobs`).
        contexts = [
            prompts[index // request.n][1][-MAX_CHAR_TOKENS:] for index in range(num_choices)
        ]

        def content(index, completion):
            echo, echoed = "", None
            if index in unechoed:
                unechoed.discard(index)
                first = state.prompt_outputs[index // request.n]
                echo = prompts[index // request.n][0]
                prompt = (first.prompt_token_ids, first.prompt_logprobs)
                echoed = self._token_logprobs(*prompt, 0, num_top, as_ids, [])
                offsets[index] = sum(len(token) for token in echoed["tokens"])
            logprobs = self._logprobs(completion, offsets[index], num_top, as_ids, contexts[index])
            contexts[index] = [*contexts[index], *completion.token_ids][-MAX_CHAR_TOKENS:]
            if logprobs is not None and logprobs["tokens"]:
                offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            if echoed is not None and logprobs is not None:
                logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
            return [{"text": echo + completion.text, "logprobs": logprobs}]

        def finish(index, completion):
            return [finish_chunk(completion, text="")]

        num_prompt = sum(len(ids) for _, ids, _ in prompts)
        async for event in stream_choices(
            streams,
            request.n,
            writer,
            num_prompt,
            content,
            finish,
            on_usage,
            self.settings.prompt_tokens_details,
            state,
        ):
            yield event
