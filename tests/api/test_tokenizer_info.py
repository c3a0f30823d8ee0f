"""GET /tokenizer_info: the tokenizer's configuration, as lm-evaluation-harness' remote
tokenizer reads it beside /tokenize."""

from __future__ import annotations

import json

import httpx
from jinja2 import BaseLoader, Environment, StrictUndefined
from tiny_models import build_tokenizer

from serve.api.tokenizer_info import tokenizer_info

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_fields_are_the_tokenizers(http, server, tokenizer):
    info = http.get("/tokenizer_info").json()
    for name in ("eos_token", "bos_token", "pad_token"):
        assert info[name] == getattr(tokenizer, name)
    assert info["chat_template"] == tokenizer.chat_template
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["model_max_length"] == tokenizer.model_max_length
    assert info["clean_up_tokenization_spaces"] is False
    assert info["added_tokens_decoder"] == {
        str(i): token.content for i, token in tokenizer.added_tokens_decoder.items()
    }
    assert info["name_or_path"] == server.model
    assert not any(key.endswith("_file") for key in info)


def test_the_harness_renders_and_tokenizes_as_the_server(http, server, tokenizer):
    """lm-evaluation-harness (`tokenizer_backend=remote`) renders `chat_template` with its
    own jinja2 environment, tokenizes through /tokenize and finds eos by its text: the same
    prompt ids as the server's own rendering, and the tokenizer's eos id."""
    info = http.get("/tokenizer_info").json()
    env = Environment(loader=BaseLoader, undefined=StrictUndefined, keep_trailing_newline=True)
    text = env.from_string(info["chat_template"]).render(
        messages=CONVERSATION, add_generation_prompt=True
    )
    ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    served = http.post("/tokenize", json={"model": server.model, "messages": CONVERSATION})
    assert ids["tokens"] == served.json()["tokens"]
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"][0] == tokenizer.eos_token_id


def test_the_servers_chat_template_wins():
    tokenizer = build_tokenizer()
    info = tokenizer_info(tokenizer, "{{ messages[0]['content'] }}", "served")
    assert info["chat_template"] == "{{ messages[0]['content'] }}"
    assert info["name_or_path"] == "served"
    json.dumps(info)  # plain JSON: added tokens as their text
    tokenizer = build_tokenizer().__class__(
        tokenizer_object=build_tokenizer().backend_tokenizer, eos_token="<|endoftext|>"
    )
    assert "chat_template" not in tokenizer_info(tokenizer, None, "served")


def test_needs_the_api_key(server_factory):
    """test_errors' keyed server."""
    server = server_factory("--api-key", "secret", "--served-model-name", "tiny")
    assert httpx.get(f"{server.url}/tokenizer_info").status_code == 401
    keyed = httpx.get(f"{server.url}/tokenizer_info", headers={"Authorization": "Bearer secret"})
    assert keyed.json()["name_or_path"] == "tiny"
