"""A server on a public port: API keys on every path but the probes, CORS only for the
origins named, request chat templates only when trusted, and no template that runs code."""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from api.openai_errors import assert_openai_error
from tiny_models import build_tokenizer

from serve.api.auth import is_authorized
from serve.api.cli import api_keys, build_parser, comma_list, cors, origins
from serve.api.settings import Cors
from serve.chat.rendering import ChatRenderError, render_chat

KEYS = ("key-one", "key-two")
ENV_KEYS = ("env-one", "env-two")
ORIGIN = "https://app.example.com"
OTHER_ORIGIN = "https://other.example.com"
MESSAGES = [{"role": "user", "content": "Hello!"}]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed(server_factory):
    """Two keys, one flag each."""
    return server_factory("--api-key", KEYS[0], "--api-key", KEYS[1])


@pytest.fixture(scope="module")
def browser_facing(server_factory):
    """Keys from the environment, CORS for two origins, and a public /metrics."""
    return server_factory(
        "--allowed-origins",
        f"{ORIGIN}, https://second.example.com",
        "--allowed-methods",
        '["*"]',
        "--allow-credentials",
        "--metrics-public",
        env={"SERVE_API_KEY": ",".join(ENV_KEYS)},
    )


# -- API keys --------------------------------------------------------------------------

GUARDED = [
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/metrics"),  # public only with --metrics-public
    ("GET", "/no-such-route"),  # a client without a key learns nothing of the routes
    ("POST", "/v1/no-such-route"),
    ("GET", "/health/"),  # public paths match exactly
]


@pytest.mark.parametrize(("method", "path"), GUARDED)
def test_every_path_needs_a_key(keyed, method, path):
    resp = httpx.request(method, keyed.url + path, json={}, timeout=60)
    error = assert_openai_error(resp, 401)
    assert error["type"] == "authentication_error"
    assert resp.headers["www-authenticate"] == "Bearer"


def test_refusals_are_in_the_access_log(keyed):
    assert_openai_error(httpx.post(f"{keyed.url}/tokenize", json={}), 401)
    deadline = time.monotonic() + 5
    while '"POST /tokenize" 401' not in keyed.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert '"POST /tokenize" 401' in keyed.log()


def test_probes_need_no_key(keyed):
    assert httpx.get(f"{keyed.url}/health").status_code == 200
    assert httpx.get(f"{keyed.url}/version").status_code == 200


@pytest.mark.parametrize("key", KEYS)
def test_each_key_opens_every_path(keyed, key):
    with httpx.Client(base_url=keyed.url, headers=bearer(key), timeout=60) as http:
        assert http.get("/v1/models").status_code == 200
        tokens = http.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "Hello"}
        assert http.get("/openapi.json").json()["info"]["title"] == "serve"
        assert_openai_error(http.get("/no-such-route"), 404)
    completion = keyed.client(api_key=key).completions.create(
        model=keyed.model, prompt="Hi", max_tokens=2
    )
    assert len(completion.choices) == 1


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer wrong",
        KEYS[0],  # no scheme
        f"Basic {KEYS[0]}",
        f"Bearer {KEYS[0]}x",
        f"Bearer {KEYS[0][:-1]}",
        f"Bearer  {KEYS[0]}",
        f"Bearer {KEYS[0]},{KEYS[1]}",
        "Bearer",
        "",
    ],
)
def test_wrong_keys_are_refused(keyed, authorization):
    resp = httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": authorization})
    assert_openai_error(resp, 401)


def test_the_scheme_is_case_insensitive(keyed):
    """RFC 9110: an authentication scheme is matched case-insensitively."""
    resp = httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": f"bearer {KEYS[1]}"})
    assert resp.status_code == 200


def test_keys_from_the_environment(browser_facing):
    for key in ENV_KEYS:
        resp = httpx.post(f"{browser_facing.url}/tokenize", json={"prompt": "Hi"})
        assert_openai_error(resp, 401)
        resp = httpx.post(
            f"{browser_facing.url}/tokenize", json={"prompt": "Hi"}, headers=bearer(key)
        )
        assert resp.status_code == 200


def test_metrics_public(browser_facing):
    """With --metrics-public, /metrics answers without a key (404 until the route exists
    on this branch); every other path still needs one."""
    assert httpx.get(f"{browser_facing.url}/metrics").status_code != 401
    assert_openai_error(httpx.get(f"{browser_facing.url}/metricsx"), 401)


def test_every_key_is_compared(monkeypatch):
    """No early exit: the first key matching costs the same comparisons as none."""
    calls = []
    compare = secrets.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(b)
        return compare(a, b)

    monkeypatch.setattr(secrets, "compare_digest", counting)
    keys = [b"first", b"second", b"third"]
    for authorization, expected in [
        (b"Bearer first", True),
        (b"Bearer third", True),
        (b"Bearer none", False),
        (b"Basic first", False),
    ]:
        calls.clear()
        assert is_authorized(authorization, keys) is expected
        assert calls == keys


def test_api_keys_from_flags_and_environment():
    assert api_keys(None, {}) == ()
    assert api_keys(None, {"SERVE_API_KEY": "a, b,,c"}) == ("a", "b", "c")
    # A vLLM deployment's variable guards the server too; serve's own wins over it.
    assert api_keys(None, {"VLLM_API_KEY": "v"}) == ("v",)
    assert api_keys(None, {"VLLM_API_KEY": "v", "SERVE_API_KEY": "s"}) == ("s",)
    for variable in ("SERVE_API_KEY", "VLLM_API_KEY"):
        for unset in ("", " ", ","):  # `-e SERVE_API_KEY="$UNSET"` must not open the server
            with pytest.raises(ValueError, match=f"{variable} is set but empty"):
                api_keys(None, {variable: unset})
    assert api_keys(["a", "b,c"], {"SERVE_API_KEY": "ignored"}) == ("a", "b", "c")
    with pytest.raises(ValueError, match="--api-key is empty"):
        api_keys([""], {"SERVE_API_KEY": "from-env"})  # `--api-key "$UNSET"` must not open it
    assert comma_list(["*"]) == ("*",)
    assert comma_list(None) == ()


def test_allowed_origins_as_vllm_writes_them():
    assert origins(['["*"]']) == ("*",)
    assert origins(['["https://a.example", "https://b.example"]', "https://c.example"]) == (
        "https://a.example",
        "https://b.example",
        "https://c.example",
    )
    assert origins(["https://a.example,https://b.example"]) == (
        "https://a.example",
        "https://b.example",
    )
    for bad in ('["*"', "[1, 2]"):
        with pytest.raises(ValueError, match="--allowed-origins"):
            origins([bad])


# -- CORS ------------------------------------------------------------------------------


def preflight(server, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    }
    return httpx.options(f"{server.url}/v1/chat/completions", headers=headers)


def test_no_cors_by_default(server):
    resp = httpx.get(f"{server.url}/v1/models", headers={"Origin": ORIGIN})
    assert resp.status_code == 200
    assert "access-control-allow-origin" not in resp.headers
    assert "access-control-allow-origin" not in preflight(server, ORIGIN).headers


@pytest.mark.parametrize("origin", [ORIGIN, "https://second.example.com"])
def test_cors_preflight_from_an_allowed_origin(browser_facing, origin):
    resp = preflight(browser_facing, origin)  # no Authorization: preflights never carry it
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == origin
    assert "POST" in resp.headers["access-control-allow-methods"]
    allowed_headers = resp.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed_headers and "content-type" in allowed_headers


def test_cors_methods_and_credentials_as_flagged(browser_facing):
    """vLLM's --allowed-methods '["*"]' lets a PUT preflight through (the methods were
    fixed at GET, POST, DELETE), and --allow-credentials says so to the browser."""
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "PUT"}
    resp = httpx.options(f"{browser_facing.url}/v1/chat/completions", headers=headers)
    assert resp.status_code == 200 and "PUT" in resp.headers["access-control-allow-methods"]
    assert resp.headers["access-control-allow-credentials"] == "true"


def test_cors_flags_as_vllm_writes_them():
    def parsed(*flags):
        return cors(build_parser().parse_args(["--model", "m", *flags]))

    assert parsed() == Cors()  # no origins: no CORS
    flagged = parsed("--allowed-origins", '["*"]', "--allowed-methods", "get,post")
    assert flagged.allowed_methods == ("GET", "POST") and flagged.allowed_headers == ("*",)
    headers = parsed("--allowed-origins", "*", "--allowed-headers", '["x-a", "x-b"]')
    assert headers.allowed_headers == ("x-a", "x-b") and not headers.allow_credentials
    for alone in (["--allow-credentials"], ["--allowed-methods", "PUT"]):
        with pytest.raises(ValueError, match="need --allowed-origins"):
            parsed(*alone)
    with pytest.raises(ValueError, match="--allowed-headers"):
        parsed("--allowed-origins", "*", "--allowed-headers", "[1]")


def test_cors_preflight_from_another_origin(browser_facing):
    resp = preflight(browser_facing, OTHER_ORIGIN)
    assert "access-control-allow-origin" not in resp.headers
    assert resp.status_code == 400


def test_cors_headers_on_responses(browser_facing):
    url = f"{browser_facing.url}/v1/models"
    ok = httpx.get(url, headers={"Origin": ORIGIN, **bearer(ENV_KEYS[0])})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    # A browser app can read the 401 (and tell its user the key is wrong).
    refused = httpx.get(url, headers={"Origin": ORIGIN})
    assert_openai_error(refused, 401)
    assert refused.headers["access-control-allow-origin"] == ORIGIN
    foreign = httpx.get(url, headers={"Origin": OTHER_ORIGIN, **bearer(ENV_KEYS[0])})
    assert "access-control-allow-origin" not in foreign.headers


# -- chat templates --------------------------------------------------------------------

# Each tries to reach Python from inside a template; {marker} is a file it would create.
HOSTILE_TEMPLATES = [
    "{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "{{ lipsum.__globals__['os'].popen('touch {marker}').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% set x = messages.append({'role': 'user', 'content': '{marker}'}) %}",
    "{{ raise_exception.__globals__['os'].system('touch {marker}') }}",
]


def hostile(template: str, marker: Path) -> str:
    return template.replace("{marker}", str(marker))


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES)
def test_templates_render_in_a_sandbox(template, tmp_path):
    """transformers renders chat templates in jinja2's ImmutableSandboxedEnvironment: no
    attribute starting with `_`, no mutating the messages. A blocked template is refused
    (the server's 400)."""
    marker = tmp_path / "template-ran"
    with pytest.raises(ChatRenderError, match="unsafe"):
        render_chat(build_tokenizer(), MESSAGES, True, hostile(template, marker))
    assert not marker.exists()


def test_a_request_chat_template_is_refused_by_default(server):
    body = {"model": server.model, "messages": MESSAGES, "chat_template": "{{ 'Hi' }}"}
    resp = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
    error = assert_openai_error(resp, 400, param="chat_template")
    assert "--trust-request-chat-template" in error["message"]


@pytest.fixture(scope="module")
def markers(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("template-markers")


@pytest.fixture(scope="module")
def trusting(server_factory, markers):
    """Trusts requests' templates, and was started with a hostile --chat-template."""
    template_file = markers / "hostile.jinja"
    template_file.write_text(hostile(HOSTILE_TEMPLATES[0], markers / "server-template-ran"))
    return server_factory("--trust-request-chat-template", "--chat-template", str(template_file))


def test_a_trusted_request_template_is_rendered(trusting, tokenizer):
    body = {"model": trusting.model, "messages": MESSAGES, "max_tokens": 1}
    resp = httpx.post(
        f"{trusting.v1}/chat/completions", json={**body, "chat_template": "{{ 'Hello' }}"}
    )
    assert resp.status_code == 200, resp.text
    expected = len(tokenizer("Hello", add_special_tokens=False).input_ids)
    assert resp.json()["usage"]["prompt_tokens"] == expected


def test_template_variables_reach_the_template(trusting, tokenizer):
    """vLLM's chat_template_kwargs, on chat and on /tokenize's messages form alike."""
    template = {"chat_template": "{{ greeting }} {{ messages[0]['content'] }}"}
    fields = {**template, "messages": MESSAGES, "chat_template_kwargs": {"greeting": "Hello"}}
    expected = tokenizer(f"Hello {MESSAGES[0]['content']}", add_special_tokens=False).input_ids
    chat = httpx.post(
        f"{trusting.v1}/chat/completions", json={**fields, "model": trusting.model, "max_tokens": 1}
    )
    assert chat.json()["usage"]["prompt_tokens"] == len(expected)
    assert httpx.post(f"{trusting.url}/tokenize", json=fields).json()["tokens"] == expected
    reserved = {**fields, "chat_template_kwargs": {"add_generation_prompt": False}}
    refused = httpx.post(f"{trusting.url}/tokenize", json=reserved)
    assert "add_generation_prompt" in assert_openai_error(refused, 400)["message"]


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES[:2])
def test_a_hostile_request_template_is_a_400(trusting, markers, template):
    marker = markers / "request-template-ran"
    body = {"model": trusting.model, "messages": MESSAGES, "max_tokens": 1}
    resp = httpx.post(
        f"{trusting.v1}/chat/completions",
        json={**body, "chat_template": hostile(template, marker)},
        timeout=60,
    )
    assert "unsafe" in assert_openai_error(resp, 400)["message"]
    assert not marker.exists()


def test_a_hostile_server_template_runs_no_code(trusting, markers):
    body = {"model": trusting.model, "messages": MESSAGES, "max_tokens": 1}
    resp = httpx.post(f"{trusting.v1}/chat/completions", json=body, timeout=60)
    assert "unsafe" in assert_openai_error(resp, 400)["message"]
    resp = httpx.post(f"{trusting.url}/tokenize", json={"messages": MESSAGES}, timeout=60)
    assert_openai_error(resp, 400)
    assert not (markers / "server-template-ran").exists()
    assert trusting.process.poll() is None


# -- pickled weights -------------------------------------------------------------------


def test_pt_load_format_needs_allow_pickle_weights(tiny_llama):
    cmd = [sys.executable, "-m", "serve.api.cli", "--model", str(tiny_llama)]
    result = subprocess.run(
        [*cmd, "--load-format", "pt"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2  # a bad command line, as argparse reports one
    assert "--allow-pickle-weights" in result.stderr
