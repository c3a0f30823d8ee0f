"""Errors in OpenAI's shape, API keys, and models without a chat template. Bad input of
every kind, and the server serving on after it, is in test_bad_input.py."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
from api.openai_errors import assert_openai_error
from tiny_models import CHATML_TEMPLATE

MESSAGES = [{"role": "user", "content": "Hello!"}]


def chat(server, **fields) -> dict:
    return {"model": server.model, "messages": MESSAGES, "max_tokens": 2, **fields}


def test_stream_options_need_stream(http, server):
    body = chat(server, stream_options={"include_usage": True})
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error" and "stream" in error["message"]


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": [10**6]},
        {"prompt": 5},
        {"logprobs": 50},
        {"prompt_logprobs": 1, "stream": True},
        {"suffix": "x"},
        {"n": 3, "best_of": 2},
        {"best_of": 3, "stream": True},  # the best cannot be known until the end
        {"use_beam_search": True, "best_of": 2, "temperature": 0.7},
        {"use_beam_search": True, "best_of": 2, "stop": "x"},
        {"n": 200, "best_of": 300},
    ],
)
def test_completion_bad_values_are_400(http, server, fields):
    body = {"model": server.model, "prompt": "Hi", "max_tokens": 2, **fields}
    assert_openai_error(http.post("/v1/completions", json=body), 400)


def test_missing_required_fields_are_400(http, server):
    assert_openai_error(http.post("/v1/chat/completions", json={"model": server.model}), 400)
    assert_openai_error(http.post("/v1/completions", json={"model": server.model}), 400)


def test_model_may_be_omitted_or_the_path(http, server, tiny_llama):
    for body in ({"messages": MESSAGES, "max_tokens": 2}, chat(server, model=str(tiny_llama))):
        assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_unknown_fields_are_accepted(http, server):
    body = chat(server, frequency_penalty=0.0, some_future_field={"a": 1}, tool_choice="none")
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    body = {"model": server.model, "prompt": "Hi", "max_tokens": 2, "best_of": 1, "x": None}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_openai_client_raises_typed_errors(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hi")


# -- API keys --------------------------------------------------------------------------


def test_api_key_flag(server_factory):
    server = server_factory("--api-key", "secret", "--served-model-name", "tiny")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200  # probes need no key
        assert_openai_error(http.get("/v1/models"), 401)
        wrong = {"Authorization": "Bearer wrong"}
        assert_openai_error(http.get("/v1/models", headers=wrong), 401)
        error = assert_openai_error(
            http.post(
                "/v1/chat/completions", json=chat(server), headers={"Authorization": "secret"}
            ),
            401,
        )
        assert error["type"] == "authentication_error"
        right = {"Authorization": "Bearer secret"}
        assert http.get("/v1/models", headers=right).json()["data"][0]["id"] == "tiny"

    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    good = server.client(api_key="secret")
    assert [m.id for m in good.models.list()] == ["tiny"]
    resp = good.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert resp.model == "tiny" and resp.choices[0].message.role == "assistant"


def test_api_key_from_environment(server_factory):
    server = server_factory(env={"SERVE_API_KEY": "from-env"})
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    resp = server.client(api_key="from-env").completions.create(
        model=server.model, prompt="Hi", max_tokens=2
    )
    assert len(resp.choices) == 1
    assert httpx.get(f"{server.url}/health").status_code == 200


# -- chat templates --------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_template_model(tiny_llama, tmp_path_factory):
    """The tiny llama with its tokenizer's chat template removed (wherever it was saved)."""
    model_dir = tmp_path_factory.mktemp("no-template") / "tiny-llama"
    shutil.copytree(tiny_llama, model_dir)
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    (model_dir / "chat_template.json").unlink(missing_ok=True)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))

    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(model_dir).chat_template is None
    return model_dir


def test_chat_without_template_says_how_to_fix(server_factory, no_template_model):
    server = server_factory(model=no_template_model)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        error = assert_openai_error(http.post("/v1/chat/completions", json=chat(server)), 400)
        assert "--chat-template" in error["message"]
        body = {"model": server.model, "prompt": "Hi", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200
        assert_openai_error(http.post("/tokenize", json={"messages": MESSAGES}), 400)


def test_chat_template_flag(server_factory, no_template_model, tmp_path_factory, server):
    template = tmp_path_factory.mktemp("template") / "chatml.jinja"
    template.write_text(CHATML_TEMPLATE)
    templated = server_factory("--chat-template", str(template), model=no_template_model)
    kwargs = dict(messages=MESSAGES, temperature=0, max_tokens=8)
    got = templated.client().chat.completions.create(model=templated.model, **kwargs)
    # same weights, same template: the same answer as the model that ships the template
    want = server.client().chat.completions.create(model=server.model, **kwargs)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage == want.usage
    # The template itself in place of a file, as vLLM takes it.
    inline = server_factory("--chat-template", CHATML_TEMPLATE, model=no_template_model)
    got = inline.client().chat.completions.create(model=inline.model, **kwargs)
    assert got.choices[0].message.content == want.choices[0].message.content
