"""What an operator sets up around the API, with vLLM's flags: model aliases, probes,
the access log and its request ids, a proxy's path prefix, TLS."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time

import anthropic
import httpx
import pytest

from tests.api.conftest import REPO_ROOT, free_port, stop_process

QUIET = "/health,/ping"
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def operated(server_factory):
    return server_factory(
        "--served-model-name",
        "main-name",
        "alias",
        "--disable-access-log-for-endpoints",
        QUIET,
        "--root-path",
        "/llm",
        "--disable-fastapi-docs",
        "--enable-force-include-usage",
        "--return-tokens-as-token-ids",
        "--enable-prompt-tokens-details",
    )


def _wait_for_line(server, text: str) -> None:
    deadline = time.monotonic() + 5
    while text not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert text in server.log()


def test_every_served_name_answers_and_replies_carry_the_first(operated):
    client = operated.client()
    assert operated.model == "main-name"
    cards = client.models.list().data
    assert [c.id for c in cards] == ["main-name", "alias"]
    assert client.models.retrieve("alias").id == "alias"
    reply = client.completions.create(model="alias", prompt="Once", max_tokens=2)
    assert reply.model == "main-name"  # as in vLLM, whose metrics carry the first name too
    missing = httpx.post(
        f"{operated.v1}/completions", json={"model": "other", "prompt": "x"}, timeout=30
    )
    assert missing.status_code == 404
    assert "`main-name`, `alias`" in missing.json()["error"]["message"]
    card = httpx.get(f"{operated.v1}/models", timeout=30).json()["data"][0]
    assert card["root"] == "main-name" and card["parent"] is None
    # Anthropic's SDK pages them.
    claude = anthropic.Anthropic(base_url=operated.url, api_key="unused", max_retries=0)
    first = claude.models.list(limit=1)
    assert [m.id for m in first.data] == ["main-name"] and first.has_more
    assert [m.id for m in claude.models.list(limit=1)] == ["main-name", "alias"]  # page by page
    assert [m.id for m in claude.models.list(before_id="alias").data] == ["main-name"]


def test_forced_usage_comes_with_every_stream(operated):
    stream = operated.client().completions.create(
        model=operated.model, prompt="Once", max_tokens=3, stream=True, extra_body=IGNORE_EOS
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 3 and not chunks[-1].choices
    # Each chunk its choice's usage so far, as continuous_usage_stats gives it.
    counted = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counted == sorted(counted) and counted[-1] == 3 and counted[0] >= 1


def test_usage_tells_the_prompt_tokens_the_cache_held(operated):
    """vLLM's --enable-prompt-tokens-details: a prompt sent again finds its full blocks in
    the prefix cache, and usage says how many tokens (they were never told); so does the
    Responses API's input_tokens_details, always (it said 0)."""
    client = operated.client()
    prompt = "A long and winding prompt about the sea, the sky and the wind. " * 6
    common = dict(model=operated.model, max_tokens=2, extra_body=IGNORE_EOS)
    first = client.completions.create(prompt=prompt, **common).usage
    again = client.completions.create(prompt=prompt, **common).usage
    full_blocks = first.prompt_tokens // 16 * 16  # the last, partial block is computed
    assert again.prompt_tokens_details.cached_tokens >= full_blocks - 16 > 0
    assert again.prompt_tokens_details.cached_tokens < again.prompt_tokens
    streamed = list(client.completions.create(prompt=prompt, stream=True, **common))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == (
        again.prompt_tokens_details.cached_tokens
    )
    messages = [{"role": "user", "content": prompt}]
    client.chat.completions.create(messages=messages, **common)
    chat = client.chat.completions.create(messages=messages, **common).usage
    assert chat.prompt_tokens_details.cached_tokens > 0
    client.responses.create(model=operated.model, input=prompt, max_output_tokens=2)
    reply = client.responses.create(model=operated.model, input=prompt, max_output_tokens=2)
    assert reply.usage.input_tokens_details.cached_tokens > 0


def test_tokens_as_token_ids_by_flag_and_by_request(operated):
    """vLLM's return_tokens_as_token_ids, as RL trainers read logprobs: "token_id:N"."""
    client = operated.client()
    kwargs = dict(model=operated.model, prompt="Once", max_tokens=5, logprobs=2, temperature=0)
    by_id = client.completions.create(**kwargs, extra_body=IGNORE_EOS).choices[0]
    ids = [int(token.removeprefix("token_id:")) for token in by_id.logprobs.tokens]
    assert all(key.startswith("token_id:") for top in by_id.logprobs.top_logprobs for key in top)
    as_text = client.completions.create(
        **kwargs, extra_body={**IGNORE_EOS, "return_tokens_as_token_ids": False}
    ).choices[0]
    assert as_text.text == by_id.text  # greedy: the same tokens, named two ways
    texts = [
        httpx.post(f"{operated.url}/detokenize", json={"tokens": [i]}, timeout=10).json()["prompt"]
        for i in ids
    ]
    assert texts == as_text.logprobs.tokens
    chat = client.chat.completions.create(
        model=operated.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    for entry in chat.choices[0].logprobs.content:
        assert entry.token.startswith("token_id:") and bytes(entry.bytes) == entry.token.encode()
        assert all(alt.token.startswith("token_id:") for alt in entry.top_logprobs)


def test_ping_is_the_health_probe_by_get_and_post(operated):
    assert httpx.get(f"{operated.url}/ping", timeout=10).status_code == 200
    assert httpx.post(f"{operated.url}/ping", timeout=10).status_code == 200


def test_quiet_paths_stay_out_of_the_access_log_and_request_ids_come_back(operated):
    for _ in range(3):
        assert httpx.get(f"{operated.url}/health", timeout=10).status_code == 200
    own = httpx.get(f"{operated.url}/version", headers={"X-Request-Id": "trace-17"}, timeout=10)
    assert own.headers["x-request-id"] == "trace-17"
    _wait_for_line(operated, 'trace-17 "GET /version" 200')  # the path as asked
    assert '"GET /health"' not in operated.log()
    # An id the log could not show as one plain word is replaced, never echoed.
    odd = httpx.get(f"{operated.url}/version", headers={"X-Request-Id": "a b\tc"}, timeout=10)
    assert odd.headers["x-request-id"] not in ("a b\tc", "")
    # A quiet path that fails is still logged.
    refused = httpx.delete(f"{operated.url}/health", timeout=10)
    assert refused.status_code == 405
    _wait_for_line(operated, f'{refused.headers["x-request-id"]} "DELETE /health" 405')


def test_the_proxys_prefix_is_the_apps_root_path(server_factory, operated):
    """With --root-path /llm the API answers on the plain paths (a proxy that strips the
    prefix) and on the prefixed ones (a proxy that passes it on; they were 404s), as vLLM's
    does; the schema's servers list carries the prefix, so generated clients call through
    it. A path that only starts with the same letters is not the prefix."""
    for base in (operated.url, f"{operated.url}/llm"):
        assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 200
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    missing = httpx.get(f"{operated.url}/llmx/v1/models", timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "No route GET /llmx/v1/models."
    assert httpx.get(f"{operated.url}/openapi.json", timeout=10).status_code == 404
    # Written loosely, it is the same prefix ("/llm/" answered only "/llm//health").
    prefixed = server_factory("--root-path", "llm/")
    schema = httpx.get(f"{prefixed.url}/openapi.json", timeout=10).json()
    assert schema["servers"] == [{"url": "/llm"}]
    assert "/v1/chat/completions" in schema["paths"]
    assert httpx.get(f"{prefixed.url}/llm/health", timeout=10).status_code == 200
    assert "deprecated" not in prefixed.log()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    return key, cert


def test_tls_with_vllms_flags(tiny_llama, certificate, tmp_path, monkeypatch):
    key, cert = certificate
    port = free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("SERVE_API_KEY", "VLLM_API_KEY")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    command = [sys.executable, "-m", "serve.api.cli", "--model", str(tiny_llama)]
    command += ["--port", str(port), "--kv-cache-memory", "64MiB"]
    command += ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    trust = ssl.create_default_context(cafile=str(cert))
    try:
        url = f"https://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{url}/health", verify=trust, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        reply = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "Once", "max_tokens": 2},
            verify=trust,
            timeout=30,
        )
        assert reply.status_code == 200, log.read_text()
        assert reply.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.TransportError):  # no plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert f"Serving {tiny_llama} at https://" in log.read_text()
        # The image's health check follows serve's flags onto HTTPS.
        monkeypatch.syspath_prepend(str(REPO_ROOT / "docker"))
        import healthcheck

        argv = ["/opt/venv/bin/serve", "--port", str(port), "--ssl-certfile", str(cert)]
        monkeypatch.setattr(healthcheck, "serve_argv", lambda: argv)
        assert healthcheck.main() == 0
        monkeypatch.setattr(healthcheck, "serve_argv", lambda: argv[:3])
        assert healthcheck.main() == 1  # plain HTTP to the TLS port: unhealthy
    finally:
        stop_process(process)
