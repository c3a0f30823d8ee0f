"""`serve`: the command line. Parses flags, loads the model, serves the OpenAI API."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import ssl
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serve.api.engine_flags import add_engine_flags, engine_config_from_args, flag_error
from serve.api.limits import RequestLimits
from serve.api.metrics import METRIC_PREFIXES
from serve.chat.reasoning_parsers import REASONING_PARSERS
from serve.chat.tool_parsers import TOOL_PARSERS
from serve.config import InvalidSettingError
from serve.engine.protocol import EngineStartError
from serve.process_exit import exit_now

if TYPE_CHECKING:
    from serve.api.served_models import ServedModels
    from serve.api.settings import Cors

logger = logging.getLogger("serve")


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)", except where the help says the default in words already
    or there is none to show (None)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if "default" in help or action.default is None:
            return help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve",
        description="Serve an LLM over an OpenAI-compatible HTTP API. "
        "(`serve bench --help`: the load tool.)",
        formatter_class=_DefaultsHelpFormatter,
        # Flags as written in full: the image's health check (docker/healthcheck.py) reads
        # --port and --host from the command line, and so may anything else that wraps it.
        allow_abbrev=False,
    )
    groups = add_engine_flags(p)  # every engine setting, from the config's fields
    model = groups["model"]
    model.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model name clients send (default: --model as given; SmolLM2-135M-Instruct "
        "for the default model); more names are aliases requests may use too, the first is "
        "the one replies and metrics carry",
    )
    model.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters to serve beside the model (needs --enable-lora), PEFT folders a "
        'request names as its model: NAME=PATH, or vLLM\'s JSON \'{"name": ..., "path": '
        '..., "base_model_name": ...}\'; several per flag, and the flag repeatable',
    )
    model.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load and "
        "unload LoRA adapters while serving (also on with vLLM's "
        "$VLLM_ALLOW_RUNTIME_LORA_UPDATING=true); any client with an API key can then make "
        "the server read any folder on this machine",
    )
    model.add_argument(
        "--chat-template",
        type=_chat_template,
        default=None,
        help="Jinja chat template, for models whose tokenizer has none: a file, or the "
        "template itself (as vLLM takes it)",
    )
    model.add_argument(
        "--default-chat-template-kwargs",
        type=_template_kwargs,
        default=None,
        metavar="JSON",
        help='template variables every chat gets, a JSON object (e.g. \'{"enable_thinking": '
        "false}'); a request's own chat_template_kwargs win, except where null or \"auto\"",
    )
    model.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=["auto", "string", "openai"],
        help="how a message's content reaches the chat template: string (its text, text "
        'parts joined by newlines), openai (OpenAI\'s list of parts, [{"type": "text", '
        '"text": ...}]), or auto: openai for a template that loops over a message\'s '
        "content, else string (as vLLM decides)",
    )
    model.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help='how to read tool calls from the output for tool_choice "auto" (the default '
        "when a request gives tools): hermes (Qwen, Hermes: <tool_call> blocks), "
        "llama3_json (Llama 3.x JSON calls) or openai (GPT-OSS's harmony calls, with "
        "--reasoning-parser openai_gptoss); without it such requests get a 400",
    )
    model.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="read a reasoning model's thinking apart from its answer: chat messages and "
        "deltas carry it as `reasoning`, Responses as a reasoning item, and structured "
        "output holds only the answer (after </think>) to its format. deepseek_r1 "
        "(DeepSeek-R1 and its distills, QwQ: the markers must be tokens of the model), "
        "deepseek_v3 (thinks when chat_template_kwargs say thinking), qwen3 (unless "
        "enable_thinking is false), openai_gptoss (GPT-OSS's harmony channels: analysis "
        "is the reasoning, final the answer; no grammar after the reasoning)",
    )
    model.add_argument(
        "--response-role",
        default="assistant",
        help="the role of a chat completion's message (and of its first streamed delta) "
        "when the request asks for a generation prompt (add_generation_prompt, true unless "
        "it says false); otherwise the role of the request's last message",
    )
    model.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='vLLM\'s switch for tool_choice "auto", accepted so vLLM command lines run: '
        "here --tool-call-parser alone turns it on, and this flag needs one",
    )
    model.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='a request with tool_choice "none" is rendered without its tools (by default '
        "the template still sees them, or for a template that knows no tools serve lists "
        "them in the system message)",
    )

    server = p.add_argument_group("server")
    server.add_argument(
        "--host",
        default=os.environ.get("SERVE_HOST") or "127.0.0.1",
        help="address to listen on; without the flag, $SERVE_HOST (the Docker image sets "
        "0.0.0.0), else 127.0.0.1",
    )
    server.add_argument(
        "--port",
        type=_port,
        default=8000,
        help="port to listen on (taken before the model loads: a port in use stops serve at once)",
    )
    server.add_argument(
        "--root-path",
        type=_root_path,
        default="",
        help="the path prefix a proxy serves the API under (e.g. /llm): every route answers "
        "with it or without it (a proxy that strips it, or one that passes it on), and the "
        "URLs the app builds carry it",
    )
    server.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="verbosity of uvicorn's own log (start-up, connection errors); requests are "
        "logged by serve's access log",
    )
    server.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="log no line per request (vLLM's name; serve's access log takes uvicorn's place)",
    )
    server.add_argument(
        "--disable-access-log-for-endpoints",
        action="append",
        default=None,
        metavar="PATHS",
        help="paths whose requests are logged only when they fail, comma-separated, e.g. "
        "/health,/metrics for probes and scrapes",
    )
    server.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="serve no /openapi.json (the API's schema); serve has no /docs or /redoc pages",
    )
    server.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprobs name each token "token_id:N" rather than by its text (a request\'s '
        "own return_tokens_as_token_ids wins)",
    )
    server.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every streamed chat or completion carries usage, on each chunk and at the "
        "end, as if it asked (stream_options include_usage and continuous_usage_stats)",
    )
    server.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="chat and completions usage says how many prompt tokens the prefix cache "
        "held (prompt_tokens_details.cached_tokens, as vLLM's flag); the Responses API's "
        "input_tokens_details always does",
    )
    server.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="accepted so vLLM command lines run: every response carries X-Request-Id (the "
        "client's own where it sends one), the id the access log shows",
    )
    server.add_argument(
        "--max-num-queued-requests",
        type=_non_negative_int,
        default=1024,
        help="generation requests that may wait beyond --max-num-seqs; past them new ones "
        "get 503 with Retry-After",
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=_positive_int,
        default=16 * 1024 * 1024,
        help="larger request bodies get 413",
    )
    server.add_argument(
        "--max-n",
        type=_positive_int,
        default=RequestLimits.max_n,
        help="most choices (n) and best_of, so also the beam width, a request may ask for",
    )
    server.add_argument(
        "--max-stop-sequences",
        type=_positive_int,
        default=RequestLimits.max_stop_sequences,
        help="most entries in a request's stop, stop_token_ids and bad_words lists (each)",
    )
    server.add_argument(
        "--max-logit-bias",
        type=_positive_int,
        default=RequestLimits.max_logit_bias,
        help="most logit_bias entries in a request",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM or Ctrl-C, seconds to let running requests finish (new ones get "
        "503) before the rest end with an error",
    )
    server.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=None,
        help="seconds a generation request may run; past them it is stopped with a 504 "
        "(an error event when streamed) and its KV blocks freed (default: no limit)",
    )
    server.add_argument(
        "--grammar-compile-timeout",
        type=_positive_float,
        default=60.0,
        help="seconds to compile a request's JSON schema, regex or grammar; past them the "
        "request gets a 400",
    )
    server.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each request as the engine gets it, one INFO line (serve.api.request_log): "
        "its id, prompt text and token ids, and sampling params; never headers or keys "
        "(default: off, no request content is logged)",
    )
    server.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="vLLM's older switch, accepted so its command lines run: requests are not "
        "logged (so by default; with --enable-log-requests too, this one wins)",
    )
    server.add_argument(
        "--max-log-len",
        type=_non_negative_int,
        default=None,
        help="with --enable-log-requests, the most prompt characters and prompt token ids "
        "a line shows (default: all)",
    )
    server.add_argument(
        "--enable-server-load-tracking",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="GET /load answers the generation and embedding requests in flight, "
        '{"server_load": N} (default: off, /load answers 0)',
    )
    server.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="run the engine core on a thread of the API process, not in its own process",
    )

    security = p.add_argument_group("security")
    security.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every path but the probes (/health, "
        "/ping, /load, /version); repeat or comma-separate for several keys; without the "
        "flag, keys come from "
        "$SERVE_API_KEY (comma-separated)",
    )
    security.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without an API key (to a scraper that sends none)",
    )
    server.add_argument(
        "--metrics-names",
        default="serve",
        choices=sorted(METRIC_PREFIXES),
        help="prefix of the vLLM-shaped series on /metrics (request latencies, tokens, "
        "queue lengths, KV cache use): serve_ (Prometheus' conventions), or vllm: so that "
        "vLLM's Grafana dashboards and autoscaling rules read them unchanged",
    )
    security.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="browser origins allowed to call the API (CORS), e.g. https://app.example.com; "
        "repeat, comma-separate or give a JSON list as vLLM takes it ('[\"*\"]'), '*' for "
        "any; without it, no CORS headers",
    )
    security.add_argument(
        "--allowed-methods",
        action="append",
        default=None,
        metavar="METHOD",
        help="with --allowed-origins: the HTTP methods browsers may use, in the same forms "
        "(vLLM's '[\"*\"]' too) (default: GET, POST, DELETE: every route's)",
    )
    security.add_argument(
        "--allowed-headers",
        action="append",
        default=None,
        metavar="HEADER",
        help="with --allowed-origins: the request headers browsers may send, in the same "
        "forms (default: any, as the OpenAI SDKs send headers of their own)",
    )
    security.add_argument(
        "--allow-credentials",
        action="store_true",
        help="with --allowed-origins: browsers may send cookies and HTTP auth (CORS "
        "credentials); the API key travels in a header either way",
    )
    security.add_argument(
        "--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key"
    )
    security.add_argument(
        "--ssl-certfile", default=None, metavar="FILE", help="... and this certificate (chain)"
    )
    security.add_argument(
        "--ssl-ca-certs",
        default=None,
        metavar="FILE",
        help="CA certificates that client certificates are checked against",
    )
    security.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="client certificates: 0 not asked for, 1 checked if sent, 2 required "
        "(Python's ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)",
    )
    security.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a request's own chat_template field (sandboxed, but code all the same); "
        "without it such requests get a 400",
    )
    return p


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _chat_template(value: str) -> str:
    """The template's text: the file's, or the value itself where it is a template (holds
    `{`, as vLLM tells them apart). Checked for Jinja syntax here, not at the first chat."""
    from pathlib import Path

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = Path(value)
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise argparse.ArgumentTypeError(f"cannot read {value}: {e}") from None
    elif "{" in value:
        text = value
    else:
        raise argparse.ArgumentTypeError(
            f"no such file: {value} (a template given inline holds Jinja's {{{{ or {{%)"
        )
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise argparse.ArgumentTypeError(f"not a valid Jinja template: {e}") from None
    return text


def _root_path(value: str) -> str:
    """--root-path as routing compares it: one leading slash, none trailing ("" for none),
    so "llm", "/llm" and "/llm/" are the same prefix."""
    stripped = value.strip().strip("/")
    return f"/{stripped}" if stripped else ""


def _json_object_argument(value: str) -> dict:
    """A flag's value that must be a JSON object (argparse's error otherwise)."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {value} ({e})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value}")
    return parsed


def _template_kwargs(value: str) -> dict:
    """--default-chat-template-kwargs: a JSON object of template variables, none of them
    an argument the rendering sets itself."""
    from serve.chat.rendering import RENDERING_ARGUMENTS

    kwargs = _json_object_argument(value)
    reserved = sorted(set(kwargs) & RENDERING_ARGUMENTS)
    if reserved:
        raise argparse.ArgumentTypeError(
            f"{reserved} are set by each request's own fields, not as template variables"
        )
    return kwargs


@dataclass(frozen=True)
class LoRAModulePath:
    """One adapter of --lora-modules (vLLM's name and fields)."""

    name: str
    path: str
    base_model_name: str | None = None  # the served name its card gives as parent


def _lora_module(value: str) -> LoRAModulePath:
    """One --lora-modules adapter in vLLM's forms: NAME=PATH, or a JSON object with name,
    path and optionally base_model_name."""
    if not value.lstrip().startswith("{"):
        name, is_pair, path = value.partition("=")
        if not (is_pair and name and path):
            raise argparse.ArgumentTypeError(
                f"{value!r} is not NAME=PATH nor a JSON object (name, path, base_model_name)"
            )
        return LoRAModulePath(name, path)
    fields = _json_object_argument(value)
    unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown fields {unknown} in {value}: an adapter has name, path and base_model_name"
        )
    text_fields = {"name": True, "path": True, "base_model_name": False}  # required?
    for key, required in text_fields.items():
        field = fields.get(key)
        if (field is not None or required) and not (isinstance(field, str) and field):
            raise argparse.ArgumentTypeError(f"{key} must be a non-empty string in {value}")
    return LoRAModulePath(fields["name"], fields["path"], fields.get("base_model_name"))


RUNTIME_LORA_VARIABLE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating(flag: bool, environ: Mapping[str, str]) -> bool:
    """--allow-runtime-lora-updating, or vLLM's variable set to 1 or true (its spelling)."""
    return flag or environ.get(RUNTIME_LORA_VARIABLE, "0").strip().lower() in ("1", "true")


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1 to 65535, got {value}")
    return value


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads (a port in use fails then, not
    after the load); uvicorn listens on it once the server is up. Not inherited by the
    engine's processes (Python's sockets are not)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn chooses
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def comma_list(values: list[str] | None) -> tuple[str, ...]:
    """The items of a repeatable, comma-separable flag, blanks dropped."""
    items = (item.strip() for value in values or () for item in value.split(","))
    return tuple(item for item in items if item)


def origins(values: list[str] | None, flag: str = "--allowed-origins") -> tuple[str, ...]:
    """--allowed-origins (and the other CORS lists): repeated, comma-separated, or a JSON
    list (vLLM's form)."""
    listed = []
    for value in values or ():
        if value.lstrip().startswith("["):
            try:
                items = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{flag} {value}: not a JSON list ({e})") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ValueError(f"{flag} {value}: a JSON list of strings, please")
            listed.extend(items)
        else:
            listed.append(value)
    return comma_list(listed)


def cors(args: argparse.Namespace) -> Cors:
    """The CORS settings from their flags; the lists need --allowed-origins to mean
    anything, so giving them without it is a mistake said at start-up."""
    from serve.api.settings import Cors

    lists = {"--allowed-methods": args.allowed_methods, "--allowed-headers": args.allowed_headers}
    extras = [flag for flag, values in lists.items() if values] + (
        ["--allow-credentials"] if args.allow_credentials else []
    )
    allowed_origins = origins(args.allowed_origins)
    if extras and not allowed_origins:
        raise ValueError(f"{', '.join(extras)} need --allowed-origins (no CORS without it).")
    methods = origins(args.allowed_methods, "--allowed-methods")
    headers = origins(args.allowed_headers, "--allowed-headers")
    return Cors(
        allowed_origins,
        tuple(m.upper() for m in methods) or Cors.allowed_methods,
        headers or Cors.allowed_headers,
        args.allow_credentials,
    )


API_KEY_VARIABLES = ("SERVE_API_KEY", "VLLM_API_KEY")  # the first set wins


def api_keys(flag_values: list[str] | None, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The keys from --api-key, else from $SERVE_API_KEY, else vLLM's $VLLM_API_KEY. Any
    of them given but empty (a shell variable that was not set: `-e SERVE_API_KEY="$KEY"`)
    is an error, never a server open to all."""
    if flag_values is None:
        for variable in API_KEY_VARIABLES:
            if variable not in environ:
                continue
            keys = comma_list([environ[variable]])
            if not keys:
                raise ValueError(f"{variable} is set but empty; give a key, or unset the variable.")
            return keys
        return ()
    keys = comma_list(flag_values)
    if not keys:
        raise ValueError("--api-key is empty; give a key, or leave the flag out.")
    return keys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # `serve bench ...`: the load tool, not a server
        from serve.bench.cli import main as bench

        sys.exit(bench(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # SIGTERM is a normal way to stop a server: exit 0 once stopped. uvicorn takes the
    # signal while it serves, drains and shuts down (the engine with it), then raises it
    # again here.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        try:
            app, settings, sock = _load(args)
        except InvalidSettingError as e:
            parser.error(flag_error(e))  # exit 2, as for a value argparse itself rejects
        except (FileNotFoundError, ValueError, OSError, EngineStartError) as e:
            print(f"serve: error: {e}", file=sys.stderr)
            sys.exit(1)

        import uvicorn

        from serve.api.shutdown import GracefulServer

        logger.info(
            "Serving %s at %s://%s:%d%s/v1",
            settings.served_model_name,
            "https" if args.ssl_certfile else "http",
            f"[{args.host}]" if ":" in args.host else args.host,
            args.port,
            args.root_path,
        )
        if settings.request_log.enabled and args.log_level in ("warning", "error"):
            logger.warning(
                "--enable-log-requests is set, but requests are logged at INFO, below "
                "--log-level %s: none will be.",
                args.log_level,
            )
        if not settings.api_keys and args.host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning(
                "No --api-key: anyone who can reach %s:%d can use this server.",
                args.host,
                args.port,
            )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=False,  # serve's own (AccessLog) logs each request
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
        )
        engine, admission = app.state.engine, app.state.admission
        server = GracefulServer(config, engine, admission, args.shutdown_timeout)
        try:
            server.run(sockets=[sock])
        except SystemExit as stopped:  # SIGTERM, raised again once uvicorn has shut down
            code = stopped.code if isinstance(stopped.code, int) else 1
        except KeyboardInterrupt:
            code = 130  # Ctrl-C: stopped as asked, no traceback
        else:
            code = 1 if server.engine_died else 0
    except KeyboardInterrupt:  # Ctrl-C while loading
        sys.exit(130)
    # uvicorn and the engine (its lifespan's shutdown) are down: nothing is left to close.
    exit_now(code)


def check_tls_files(args: argparse.Namespace) -> None:
    """Load the TLS key and certificates as uvicorn will, to say what is wrong with them
    before the model loads rather than after."""
    if args.ssl_keyfile is None and args.ssl_certfile is None:
        if args.ssl_ca_certs is not None or args.ssl_cert_reqs:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile.")
        return
    if args.ssl_certfile is None:
        raise ValueError("--ssl-keyfile needs --ssl-certfile (and the other way round).")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs is not None:
            context.load_verify_locations(args.ssl_ca_certs)
    except OSError as e:  # ssl.SSLError is one
        raise ValueError(f"cannot use the TLS key or certificate: {e}") from None


def _checked_lora_modules(args: argparse.Namespace, enable_lora: bool) -> list[LoRAModulePath]:
    """--lora-modules, once its mistakes that need no model are ruled out."""
    modules = args.lora_modules or []
    if modules and not enable_lora:
        raise ValueError(
            "--lora-modules needs --enable-lora (the engine serves LoRA adapters only with it)."
        )
    if args.allow_runtime_lora_updating and not enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora.")
    names = [module.name for module in modules]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"--lora-modules names {twice} more than once; each needs its own.")
    return modules


async def _serve_adapters(models: ServedModels, modules: list[LoRAModulePath]) -> None:
    """The --lora-modules adapters, each checked by the engine, ids 1, 2, ... in order."""
    for module in modules:
        try:
            lora = await models.load(module.name, module.path, module.base_model_name)
        except ValueError as e:
            raise ValueError(f"--lora-modules: {e}") from None
        logger.info(
            "Serving LoRA adapter %s from %s (lora_int_id %d)",
            lora.lora_name,
            lora.lora_path,
            lora.lora_int_id,
        )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(0)


def _import_app_code() -> None:
    """The API's modules (FastAPI, the app, its models: ~1.5 s), imported while the engine
    core's process loads the model rather than before it starts."""
    import serve.api.request_log  # noqa: F401
    import serve.api.served_models  # noqa: F401
    import serve.api.server  # noqa: F401
    import serve.engine.image_inputs  # noqa: F401
    import serve.models.generation_config  # noqa: F401


def _load(args: argparse.Namespace):
    from pathlib import Path

    # The command line's own mistakes first, before the seconds that importing torch takes.
    config = engine_config_from_args(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or openai): "
            'the parser is what reads tool calls out of tool_choice "auto" output.'
        )
    keys = api_keys(args.api_key, os.environ)
    lora_modules = _checked_lora_modules(args, config.lora.enable_lora)
    cross_origin = cors(args)
    check_tls_files(args)
    try:  # before the model loads: a port in use is said at once
        sock = listening_socket(args.host, args.port)
    except OSError as e:
        raise OSError(f"cannot listen on {args.host}:{args.port}: {e}") from None

    if args.disable_frontend_multiprocessing:
        from serve.engine.async_engine import AsyncEngine

        engine = AsyncEngine.from_config(config)
    else:
        from serve.engine.core_client import EngineCoreClient

        engine = EngineCoreClient(config, while_core_loads=_import_app_code)
    from serve.api.request_log import RequestLog
    from serve.api.served_models import ServedModels
    from serve.api.server import build_app
    from serve.api.settings import ServerSettings
    from serve.engine.image_inputs import ImageInputs
    from serve.models.generation_config import generation_defaults

    model_path = str(engine.model_path)
    names = args.served_model_name or [args.model or Path(model_path).name]
    generation = generation_defaults(
        model_path, config.model.generation_config, config.model.override_generation_config
    )
    settings = ServerSettings(
        names[0],
        model_path,
        other_model_names=tuple(dict.fromkeys(names[1:])),
        api_keys=keys,
        chat_template=args.chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        chat_template_content_format=args.chat_template_content_format,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        metrics_public=args.metrics_public,
        metrics_names=args.metrics_names,
        cors=cross_origin,
        root_path=args.root_path,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        max_generating_requests=args.max_num_seqs + args.max_num_queued_requests,
        max_body_bytes=args.max_request_body_bytes,
        request_timeout_s=args.request_timeout,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        scheduling_policy=config.scheduler.scheduling_policy,
        limits=RequestLimits(args.max_n, args.max_stop_sequences, args.max_logit_bias),
        response_store=config.responses,
        sampling_defaults=generation.sampling,
        max_tokens_cap=generation.max_tokens_cap,
        access_log=not args.disable_uvicorn_access_log,
        quiet_access_paths=frozenset(comma_list(args.disable_access_log_for_endpoints)),
        openapi_schema=not args.disable_fastapi_docs,
        force_include_usage=args.enable_force_include_usage,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        request_log=RequestLog(
            args.enable_log_requests and not args.disable_log_requests, args.max_log_len
        ),
        response_role=args.response_role,
        server_load_tracking=args.enable_server_load_tracking,
        cache=config.cache,
        lora=config.lora,
    )
    runtime_lora = runtime_lora_updating(args.allow_runtime_lora_updating, os.environ)
    models = ServedModels(settings, engine, allow_runtime_updates=runtime_lora)
    if runtime_lora:
        logger.warning(
            "LoRA adapters may be loaded and unloaded at run time (POST "
            "/v1/load_lora_adapter): any client%s can make the server read any folder on "
            "this machine. Allow it only where you trust every client.",
            " with an API key" if keys else "",
        )
    # The app reads the tokenizer: a --reasoning-parser it cannot serve is refused. Each
    # --lora-modules adapter is read by the engine's check: one it would not load is too.
    # A model that takes images has its image processor read here, beside the tokenizer.
    try:
        if lora_modules:
            asyncio.run(_serve_adapters(models, lora_modules))
        images = ImageInputs.for_model(model_path, engine.tokenizer, config.multimodal, names[0])
        app = build_app(engine, settings, models, images)
    except ValueError:
        engine.shutdown()
        raise
    return app, settings, sock


if __name__ == "__main__":
    main()
