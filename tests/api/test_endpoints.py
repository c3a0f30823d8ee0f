"""/health, /version, /v1/models (and one by id), /tokenize and /detokenize."""

from __future__ import annotations

import serve

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_health_and_version(http):
    assert http.get("/health").status_code == 200
    assert http.get("/version").json() == {"version": serve.__version__}


def test_models_list(client, server, http, tiny_llama):
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    # without --served-model-name: the --model argument (--help says its directory name)
    assert server.model in (str(tiny_llama), tiny_llama.name)
    card = http.get("/v1/models").json()["data"][0]
    assert card["object"] == "model" and card["max_model_len"] > 0


def test_model_retrieve(client, server, http):
    model = client.models.retrieve(server.model)
    assert model.id == server.model and model.object == "model"
    missing = http.get("/v1/models/no-such-model")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_tokenize_prompt_and_detokenize(http, tokenizer):
    text = "Hello, world! How are you today?"
    resp = http.post("/tokenize", json={"prompt": text}).json()
    assert resp["tokens"] == tokenizer(text).input_ids
    assert resp["count"] == len(resp["tokens"]) and resp["max_model_len"] > 0
    assert http.post("/detokenize", json={"tokens": resp["tokens"]}).json() == {"prompt": text}
    assert "token_strs" not in resp
    with_strs = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert with_strs["tokens"] == resp["tokens"]
    assert with_strs["token_strs"] == tokenizer.convert_ids_to_tokens(resp["tokens"])


def test_tokenize_messages(http, tokenizer):
    resp = http.post("/tokenize", json={"messages": MESSAGES}).json()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert resp["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    decoded = http.post("/detokenize", json={"tokens": resp["tokens"]}).json()["prompt"]
    assert decoded == text and decoded.endswith("<|im_start|>assistant\n")

    no_prompt = http.post(
        "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}
    ).json()
    assert no_prompt["count"] < resp["count"]


def test_tokenize_messages_as_chat_renders_them(client, server, http):
    """The chat fields that shape a prompt count on /tokenize as on chat: tools, a final
    message left open, and a request's template only where the server trusts them."""
    continued = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hel"}]
    open_turn = {"add_generation_prompt": False, "continue_final_message": True}
    ids = http.post("/tokenize", json={"messages": continued, **open_turn}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith("Hel")
    chat = client.chat.completions.create(
        model=server.model, messages=continued, max_tokens=1, extra_body=open_turn
    )
    assert chat.usage.prompt_tokens == len(ids)

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    plain = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    with_tool = http.post("/tokenize", json={"messages": MESSAGES, "tools": [tool]}).json()
    assert with_tool["count"] > plain

    own_template = {"messages": MESSAGES, "chat_template": "{{ 'Hi' }}"}
    refused = http.post("/tokenize", json=own_template)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    both = {"messages": continued, "continue_final_message": True}  # and a generation prompt
    refused = http.post("/tokenize", json=both)
    assert refused.status_code == 400 and "continue_final_message" in refused.text


def test_tokenize_needs_exactly_one_input(http):
    assert http.post("/tokenize", json={}).status_code == 400
    both = {"prompt": "Hi", "messages": MESSAGES}
    assert http.post("/tokenize", json=both).status_code == 400
    assert http.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
