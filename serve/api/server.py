"""The FastAPI app: routes, authentication, errors in each API's shape, access log."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

import serve
from serve.api.admission import Admission, AdmissionGate
from serve.api.auth import APIKeyAuth, public_paths
from serve.api.errors import (
    APIError,
    anthropic_error_body,
    error_body,
    error_response,
    validation_message,
)
from serve.api.json_body import JSONBodyRoute
from serve.api.metrics import ServerMetrics
from serve.api.middleware import CLIENT_CLOSED, AccessLog, InternalErrors, RootPath, route_path
from serve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIModel,
    SamplingRequest,
    TokenizeRequest,
    now,
)
from serve.api.protocol_anthropic import MessagesInput, MessagesRequest
from serve.api.protocol_embeddings import EmbeddingRequest
from serve.api.protocol_responses import ResponsesRequest
from serve.api.request_checks import PromptCharLimit, check_structured_output
from serve.api.response_store import ResponseStore
from serve.api.served_models import (
    LoadLoRAAdapterRequest,
    ServedModels,
    UnloadLoRAAdapterRequest,
)
from serve.api.serving_base import off_the_loop
from serve.api.serving_chat import ChatHandler
from serve.api.serving_completion import CompletionHandler
from serve.api.serving_embeddings import EmbeddingHandler
from serve.api.serving_messages import MessagesHandler
from serve.api.serving_responses import ResponsesHandler
from serve.api.settings import ServerSettings
from serve.api.tokenizer_info import tokenizer_info
from serve.engine.image_inputs import ImageInputs
from serve.engine.protocol import EngineClient, EngineDeadError
from serve.lora_request import LoRARequest

logger = logging.getLogger("serve.api")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_app(
    engine: EngineClient,
    settings: ServerSettings,
    models: ServedModels | None = None,
    images: ImageInputs | None = None,
) -> FastAPI:
    """The app serving `engine`, which it shuts down when the server stops (SIGTERM,
    Ctrl-C): a core process is stopped, never left behind. `models`: the names it answers
    to and its LoRA adapters (default: the base model's names, no adapters); `images`:
    the images its chat takes (default: none, as a text-only model's)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(
        title="serve",
        version=serve.__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json" if settings.openapi_schema else None,
        lifespan=lifespan,
        strict_content_type=False,  # JSONBodyRoute answers other types; none at all is JSON
    )
    app.router.route_class = JSONBodyRoute
    app.state.engine, app.state.settings = engine, settings
    prompt_chars = PromptCharLimit(engine.tokenizer, engine.max_model_len)  # reads the vocab
    served = models or ServedModels(settings, engine)
    chat = ChatHandler(engine, settings, prompt_chars, served, images)
    completions = CompletionHandler(engine, settings, prompt_chars, served)
    stored = settings.response_store
    responses = ResponsesHandler(
        chat, ResponseStore(stored.response_store_max_entries, stored.response_store_ttl_s)
    )
    messages = MessagesHandler(chat)
    embeddings = EmbeddingHandler(engine, settings, prompt_chars, served)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, route_path(request.scope))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors(), exc.body)
        body = error_body(400, message, param, path=route_path(request.scope))
        return JSONResponse(body, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "Request failed."
        if exc.status_code == 404:
            message = f"No route {request.method} {route_path(request.scope)}."
        body = error_body(exc.status_code, message, path=route_path(request.scope))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(
            error_body(503, str(exc), path=route_path(request.scope)), status_code=503
        )

    app.state.admission = admission = Admission(
        settings.max_generating_requests, settings.max_body_bytes
    )
    # The last added runs first: access log → CORS → API key → admission → last word on
    # unexpected errors → routes.
    app.add_middleware(InternalErrors)
    app.add_middleware(AdmissionGate, admission=admission)
    app.add_middleware(
        APIKeyAuth, keys=settings.api_keys, public=public_paths(settings.metrics_public)
    )
    cors = settings.cors
    if cors.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors.allowed_origins),
            allow_methods=list(cors.allowed_methods),
            allow_headers=list(cors.allowed_headers),
            allow_credentials=cors.allow_credentials,
            expose_headers=["Retry-After", "X-Request-Id"],
        )
    app.state.metrics = metrics = ServerMetrics(
        engine, settings.served_model_name, settings.metrics_names, settings.cache, settings.lora
    )
    app.add_middleware(
        AccessLog,
        on_response=metrics.count_response,
        quiet_paths=settings.quiet_access_paths,
        enabled=settings.access_log,
    )
    if settings.root_path:
        app.add_middleware(RootPath, root_path=settings.root_path)

    def _log_unknown(body: OpenAIModel) -> None:
        if body.unknown_fields:
            logger.debug("Ignoring unknown request fields: %s", ", ".join(body.unknown_fields))

    # /ping: vLLM's (SageMaker's) name for the same probe, by GET or POST.
    @app.api_route("/ping", methods=["GET", "POST"])
    @app.get("/health")
    async def health() -> Response:
        if engine.is_alive:
            return Response(status_code=200)
        message = str(engine.dead_error or "The engine is not running.")
        return JSONResponse(error_body(503, message), status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=ServerMetrics.CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": serve.__version__}

    @app.get("/load")
    async def server_load() -> dict[str, int]:
        """vLLM's load: with --enable-server-load-tracking, the generation and embedding
        requests in flight (admitted, until their response has been sent or the client
        left); without it, 0 always, as vLLM answers."""
        return {"server_load": admission.num_generating if settings.server_load_tracking else 0}

    def model_card(name: str, lora: LoRARequest | None = None) -> dict[str, Any]:
        """vLLM's card: OpenAI's fields, plus root, parent and max_model_len. An adapter's
        root is its folder (as vLLM shows it), its parent the base model it runs on."""
        return {
            "id": name,
            "object": "model",
            "created": now(),
            "owned_by": "serve",
            # the base model's: never the path on this machine
            "root": lora.lora_path if lora else settings.served_model_name,
            "parent": (lora.base_model_name or settings.served_model_name) if lora else None,
            "max_model_len": engine.max_model_len,
        }

    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")

    def anthropic_card(name: str) -> dict[str, Any]:
        """Anthropic's model object (its SDK's models.list / retrieve)."""
        return {"type": "model", "id": name, "display_name": name, "created_at": started_at}

    # One path, two APIs: Anthropic's SDK sends anthropic-version on every request.
    @app.get("/v1/models")
    async def models(
        request: Request,
        limit: int = Query(20, ge=1, le=1000),
        after_id: str | None = None,
        before_id: str | None = None,
    ) -> dict[str, Any]:
        names = list(served.names)
        if "anthropic-version" not in request.headers:
            cards = [model_card(name) for name in settings.model_names]
            cards += [model_card(lora.lora_name, lora) for lora in served.adapters]
            return {"object": "list", "data": cards}
        # Anthropic's pages: `limit` names after `after_id`, or the last before `before_id`.
        if after_id in names:
            names = names[names.index(after_id) + 1 :]
        if before_id in names:
            names = names[: names.index(before_id)]
        page = names[-limit:] if before_id is not None else names[:limit]
        return {
            "data": [anthropic_card(name) for name in page],
            "has_more": len(page) < len(names),
            "first_id": page[0] if page else None,
            "last_id": page[-1] if page else None,
        }

    @app.get("/v1/models/{model_id:path}")  # the OpenAI client's models.retrieve
    async def model(model_id: str, request: Request) -> Any:
        anthropic = "anthropic-version" in request.headers
        try:
            lora = served.resolve(model_id)
        except APIError as e:
            if not anthropic:
                raise
            return JSONResponse(anthropic_error_body(e.status, e.message), status_code=e.status)
        name = model_id if model_id in served.names else settings.served_model_name
        return anthropic_card(name) if anthropic else model_card(name, lora)

    if served.allow_runtime_updates:  # vLLM's routes, absent (404) unless allowed

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            _log_unknown(body)
            name = body.lora_name
            try:
                lora = await served.load(name, body.lora_path, replace=body.load_inplace)
            except ValueError as e:
                raise APIError(400, str(e)) from None
            logger.info(
                "Loaded LoRA adapter %s from %s (id %d)", name, lora.lora_path, lora.lora_int_id
            )
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            _log_unknown(body)
            try:
                served.unload(body.lora_name, body.lora_int_id)
            except LookupError as e:
                raise APIError(404, str(e.args[0]), param="lora_name") from None
            logger.info("Unloaded LoRA adapter %s", body.lora_name)
            return PlainTextResponse(
                f"Success: LoRA adapter '{body.lora_name}' removed successfully."
            )

    async def respond(
        handler: ChatHandler | CompletionHandler | ResponsesHandler | MessagesHandler,
        body: Any,
        request: Request,
        check_grammar: bool = False,
    ) -> Any:
        """A generation request's SSE stream, or its JSON body; a client gone before the
        body is ready gets none (its request is aborted). `check_grammar`: compile the
        body's structured output first (the Responses and Messages handlers do it as they
        map their bodies onto chat's)."""
        _log_unknown(body)
        _take_client_request_id(body, request)
        if check_grammar:
            await check_structured_output(engine, body, settings.grammar_compile_timeout_s)
        on_usage = _usage_recorder(request)
        if body.stream:
            events = await handler.stream(body, on_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        return await _json_unless_disconnected(handler.create(body, on_usage), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await respond(chat, body, request, check_grammar=True)

    @app.post("/v1/completions")
    async def create_completions(body: CompletionRequest, request: Request) -> Any:
        return await respond(completions, body, request, check_grammar=True)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        return await respond(responses, body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        return responses.retrieve(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(
        response_id: str,
        after: str | None = None,
        limit: int = 20,
        order: str = "desc",
    ) -> dict[str, Any]:
        return responses.input_items(response_id, after, limit, order)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses.delete(response_id)

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, request: Request) -> Any:
        return await respond(messages, body, request)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: MessagesInput) -> dict[str, int]:
        _log_unknown(body)
        return await messages.count_tokens(body)

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict[str, Any]:
        return tokenizer_info(engine.tokenizer, settings.chat_template, settings.served_model_name)

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> Any:
        _log_unknown(body)
        _take_client_request_id(body, request)
        work = embeddings.create(body, _usage_recorder(request))
        return await _json_unless_disconnected(work, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        served.resolve(body.model)  # the tokenizer is the base model's for every adapter
        if body.prompt is not None:  # tokenizing megabytes holds up every prompt behind it
            prompt_chars.check(body.prompt, "prompt")
        if body.messages is not None:
            ids = await chat.prompt_token_ids(body.chat_fields())
        else:
            ids = await off_the_loop(_tokenize, body)
        reply = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
        if body.return_token_strs:  # vLLM's: each id's token as the vocabulary writes it
            reply["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
        return reply

    def _tokenize(body: TokenizeRequest) -> list[int]:
        return engine.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        served.resolve(body.model)
        try:
            engine.check_token_ids(body.tokens)
        except ValueError as e:
            raise APIError(400, str(e), param="tokens") from None
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return app


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client hangs up. The body is already read (FastAPI parsed it), so
    the next message the server's `receive` gives is the disconnect, the moment it happens."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(work: Awaitable[dict[str, Any]], request: Request):
    """Await a non-streamed response, but cancel it — which aborts its requests in the
    engine and frees their blocks — as soon as the client hangs up. None if it did."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


def _take_client_request_id(body: SamplingRequest | EmbeddingRequest, request: Request) -> None:
    """A client's X-Request-Id names its response: it takes the place of the body's
    `request_id` (the header wins, as in vLLM)."""
    client_id = getattr(request.state, "client_request_id", None)
    if client_id is not None and isinstance(body, (SamplingRequest, EmbeddingRequest)):
        body.request_id = client_id


async def _json_unless_disconnected(
    work: Awaitable[dict[str, Any] | Response], request: Request
) -> Any:
    """The body (or whole response) `work` makes, or an empty 499 if the client hung up
    first."""
    result = await _unless_disconnected(work, request)
    return Response(status_code=CLIENT_CLOSED) if result is None else result


def _usage_recorder(request: Request):
    def record(counts: dict[str, int]) -> None:
        request.state.usage = counts

    return record
