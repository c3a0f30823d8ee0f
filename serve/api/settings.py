"""The API server's own settings (the flags that are not the engine's), as the CLI builds them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serve.api.limits import RequestLimits
from serve.api.request_log import RequestLog
from serve.config import CacheConfig, LoRAConfig, ResponseStoreConfig


@dataclass(frozen=True)
class Cors:
    """Which browser origins may call the API, and how (--allowed-origins and friends)."""

    allowed_origins: tuple[str, ...] = ()  # empty: no CORS headers at all
    allowed_methods: tuple[str, ...] = ("GET", "POST", "DELETE")  # every route's
    # The OpenAI SDKs send their own headers besides Authorization and Content-Type
    # (X-Stainless-*, OpenAI-Organization, ...), and no fixed list keeps up with them. The
    # API key, not CORS, is what guards the routes.
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str  # the name replies carry, and metrics' model_name
    model_path: str
    other_model_names: tuple[str, ...] = ()  # more names requests may use (aliases)
    api_keys: tuple[str, ...] = ()  # empty: no key needed
    chat_template: str | None = None
    # A request's own `chat_template` is rendered only when the operator trusts clients
    # with it (sandboxed or not, a template is code the server runs for them).
    trust_request_chat_template: bool = False
    # Template variables every chat gets unless the request sets them (vLLM's flag).
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # How content reaches the template: auto, string (text), openai (parts); content_format.py.
    chat_template_content_format: str = "auto"
    # tool_choice "none" renders no tools (vLLM's flag; else the template still sees them).
    exclude_tools_when_tool_choice_none: bool = False
    metrics_public: bool = False  # /metrics needs no key
    metrics_names: str = "serve"  # the prefix of the vLLM-shaped series: serve_ or vllm:
    cors: Cors = field(default_factory=Cors)
    root_path: str = ""  # a proxy's prefix: routes answer with it or without it
    tool_call_parser: str | None = None  # tool_choice "auto" reads calls in this format
    # Reasoning read apart from the answer (serve/chat/reasoning_parsers); None: all content.
    reasoning_parser: str | None = None
    max_generating_requests: int | None = None  # in flight, running or queued; None: no cap
    max_body_bytes: int | None = None
    request_timeout_s: float | None = None  # a generation request's deadline; None: none
    grammar_compile_timeout_s: float | None = None  # compiling a request's grammar
    scheduling_policy: str = "fcfs"  # a request's `priority` is refused under the others
    limits: RequestLimits = field(default_factory=RequestLimits)
    response_store: ResponseStoreConfig = field(default_factory=ResponseStoreConfig)
    # The generation config's values for requests that leave them out (--generation-config,
    # --override-generation-config): SamplingParams' names, `max_tokens` the budget of a
    # request that sets none. `max_tokens_cap` bounds every request's (vLLM's
    # override_max_tokens: max_new_tokens of a --generation-config folder or the override).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    max_tokens_cap: int | None = None
    access_log: bool = True  # a line per request (serve.access)
    quiet_access_paths: frozenset[str] = frozenset()  # logged only when they fail
    openapi_schema: bool = True  # GET /openapi.json
    force_include_usage: bool = False  # every stream carries usage, as if asked for
    # Chat and completions usage has prompt_tokens_details.cached_tokens (vLLM's flag).
    prompt_tokens_details: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"
    request_log: RequestLog = field(default_factory=RequestLog)  # --enable-log-requests
    # A chat completion's role after a generation prompt (without one: the last message's).
    response_role: str = "assistant"
    server_load_tracking: bool = False  # GET /load counts generation requests in flight
    # The engine's KV cache settings, which /metrics shows as cache_config_info.
    cache: CacheConfig = field(default_factory=CacheConfig)
    # The engine's LoRA settings, which /metrics shows as lora_requests_info when enabled.
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.other_model_names)
