"""Speculative decoding (n-gram) through the server: greedy completions, streamed and not,
are the plain server's, and /metrics counts the proposals checked and accepted."""

from __future__ import annotations

import json

import httpx
import pytest
from api.conftest import REQUEST_TIMEOUT_S, scrape_metrics

SPECULATIVE_CONFIG = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
)
# Greedy output over a few tokens ('co', 'em', 'ion', 'ou', 'ow', 'ver') loops, so prompt
# lookup predicts it; the prompt holds them too.
ALLOWED = list(range(300, 306))
PROMPT = [380, 280, 365, 118, 51, 303, 300, 304, 301, 305, 302] * 2


@pytest.fixture(scope="module")
def spec_server(server_factory):
    return server_factory("--speculative-config", SPECULATIVE_CONFIG)


def _body(server, stream: bool) -> dict:
    return {
        "model": server.model,
        "prompt": PROMPT,
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "allowed_token_ids": ALLOWED,
        "stream": stream,
    }


def _complete(server) -> tuple[str, str]:
    resp = httpx.post(
        f"{server.v1}/completions", json=_body(server, False), timeout=REQUEST_TIMEOUT_S
    )
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert resp.json()["usage"]["completion_tokens"] == 40
    return choice["text"], choice["finish_reason"]


def _stream(server) -> tuple[str, str | None]:
    text, finish = "", None
    body = _body(server, True)
    with httpx.stream(
        "POST", f"{server.v1}/completions", json=body, timeout=REQUEST_TIMEOUT_S
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return text, finish


def test_greedy_completions_match_the_plain_server_and_metrics_count_acceptance(
    server, spec_server
):
    expected = _complete(server)
    assert expected[1] == "length" and expected[0]
    before = scrape_metrics(spec_server)
    assert _complete(spec_server) == expected
    assert _stream(spec_server) == expected
    after = scrape_metrics(spec_server)

    def grew(name: str) -> float:
        return after[f"serve_{name}_total"] - before.get(f"serve_{name}_total", 0.0)

    assert grew("spec_decode_num_drafts") > 0
    assert grew("spec_decode_num_draft_tokens") > 0
    assert grew("spec_decode_num_accepted_tokens") > 0
    assert grew("spec_decode_num_accepted_tokens") <= grew("spec_decode_num_draft_tokens")
