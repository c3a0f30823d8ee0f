"""LoRA adapters through the server, as vLLM's users reach them: `--lora-modules` names
adapters a request picks as its `model`, /v1/models lists them, and with runtime updating
allowed POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them while serving.

Greedy output through an adapter equals HF transformers' on the base model with that
adapter merged into its weights (tiny_models.merge_tiny_lora), and differs from the base
model's. The adapters are random PEFT folders (tiny_models.make_tiny_lora)."""

from __future__ import annotations

import asyncio
import signal
import socket

import httpx
import openai
import pytest
import torch
from tiny_models import hf_embedding, hf_greedy, make_tiny_lora, merge_tiny_lora, random_prompts

from serve.api.cli import main

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
EXTRA = {"ignore_eos": True, "return_token_ids": True}
# Two adapters on different modules and ranks, and one loaded while serving.
ADAPTERS = {
    "qv-down": {"targets": ("q_proj", "v_proj", "down_proj"), "rank": 4, "seed": 1},
    "k-o-mlp": {"targets": ("k_proj", "o_proj", "gate_proj", "up_proj"), "rank": 8, "seed": 2},
    "late": {"targets": ("q_proj", "k_proj", "v_proj", "o_proj"), "rank": 4, "seed": 3},
}
PROMPT = random_prompts(512, 1, 12, 12, seed=5)[0]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """name -> (adapter folder, merged oracle model)."""
    root = tmp_path_factory.mktemp("lora-adapters")
    built = {}
    for name, options in ADAPTERS.items():
        folder = make_tiny_lora(tiny_llama, root / name, **options)
        built[name] = (folder, merge_tiny_lora(tiny_llama, folder, root / f"{name}-merged"))
    return built


@pytest.fixture(scope="module")
def expected(tiny_llama, adapters):
    """HF's greedy continuation of PROMPT: the base model's (key None), each oracle's."""
    outputs = {None: hf_greedy(tiny_llama, PROMPT, MAX_TOKENS, ignore_eos=True)}
    for name, (_, oracle) in adapters.items():
        outputs[name] = hf_greedy(oracle, PROMPT, MAX_TOKENS, ignore_eos=True)
    assert len({tuple(ids) for ids in outputs.values()}) == len(outputs)  # each changes it
    return outputs


@pytest.fixture(scope="module")
def lora_server(server_factory, adapters):
    """Two adapters from --lora-modules (both of vLLM's forms), runtime updating on by
    vLLM's variable, behind an API key."""
    qv, mlp = adapters["qv-down"][0], adapters["k-o-mlp"][0]
    return server_factory(
        "--served-model-name",
        "base",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"qv-down={qv}",
        "--lora-modules",
        f'{{"name": "k-o-mlp", "path": "{mlp}", "base_model_name": "base"}}',
        "--api-key",
        KEY,
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"},
    )


@pytest.fixture(scope="module")
def http(lora_server):
    with httpx.Client(base_url=lora_server.url, headers=AUTH, timeout=60) as client:
        yield client


def _completion_ids(client: openai.OpenAI, model: str) -> tuple[str, list[int]]:
    reply = client.completions.create(model=model, prompt=PROMPT, **GREEDY, extra_body=EXTRA)
    return reply.model, reply.model_dump()["choices"][0]["token_ids"]


def test_a_request_naming_an_adapter_runs_with_it(lora_server, expected):
    client = lora_server.client(api_key=KEY)
    assert _completion_ids(client, "qv-down") == ("qv-down", expected["qv-down"])
    assert _completion_ids(client, "k-o-mlp") == ("k-o-mlp", expected["k-o-mlp"])
    assert _completion_ids(client, "base") == ("base", expected[None])
    # Streamed, the chunks carry the adapter's name and tokens too.
    chunks = list(
        client.completions.create(
            model="qv-down", prompt=PROMPT, **GREEDY, extra_body=EXTRA, stream=True
        )
    )
    assert {chunk.model for chunk in chunks} == {"qv-down"}
    streamed = [
        t for chunk in chunks for c in chunk.model_dump()["choices"] for t in c["token_ids"]
    ]
    assert streamed == expected["qv-down"]


def test_chat_responses_messages_and_embeddings_take_the_adapter(lora_server, http, adapters):
    client = lora_server.client(api_key=KEY)
    messages = [{"role": "user", "content": "Tell me a story."}]

    def chat(model: str):
        return client.chat.completions.create(
            model=model, messages=messages, **GREEDY, extra_body=EXTRA
        )

    adapted, base = chat("k-o-mlp"), chat("base")
    assert adapted.model == "k-o-mlp" and base.model == "base"
    text = adapted.choices[0].message.content
    assert (
        adapted.model_dump()["choices"][0]["token_ids"]
        != base.model_dump()["choices"][0]["token_ids"]
    )
    # The Responses API and Anthropic's Messages run the same conversation the same way.
    response = client.responses.create(
        model="k-o-mlp",
        input=messages,
        temperature=0.0,
        max_output_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True},
    )
    assert response.model == "k-o-mlp" and response.output_text == text
    message = http.post(
        "/v1/messages",
        json={
            "model": "k-o-mlp",
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    ).json()
    assert message["model"] == "k-o-mlp" and message["content"][0]["text"] == text
    # Embeddings: the merged model's final hidden state (the last token's, L2-normalised).
    embedding = client.embeddings.create(model="k-o-mlp", input=PROMPT).data[0].embedding
    oracle = hf_embedding(adapters["k-o-mlp"][1], PROMPT)
    assert torch.allclose(torch.tensor(embedding), oracle, atol=1e-4)
    base_embedding = client.embeddings.create(model="base", input=PROMPT).data[0].embedding
    assert not torch.allclose(torch.tensor(base_embedding), oracle, atol=1e-2)
    tokens = http.post("/tokenize", json={"model": "k-o-mlp", "prompt": "Hi"})
    assert tokens.status_code == 200


def test_base_and_adapters_interleaved_in_one_batch_each_get_their_own(lora_server, expected):
    models = ["base", "qv-down", "k-o-mlp"] * 3

    async def run() -> list[tuple[str, list[int]]]:
        client = lora_server.async_client(api_key=KEY)
        replies = await asyncio.gather(
            *(
                client.completions.create(model=m, prompt=PROMPT, **GREEDY, extra_body=EXTRA)
                for m in models
            )
        )
        return [(r.model, r.model_dump()["choices"][0]["token_ids"]) for r in replies]

    names = {"base": None, "qv-down": "qv-down", "k-o-mlp": "k-o-mlp"}
    assert asyncio.run(run()) == [(m, expected[names[m]]) for m in models]


def test_models_lists_the_adapters_after_the_base_model(lora_server, http, adapters):
    cards = http.get("/v1/models").json()["data"]
    assert [card["id"] for card in cards] == ["base", "qv-down", "k-o-mlp"]
    base, qv, mlp = cards
    assert base["root"] == "base" and base["parent"] is None
    assert qv["root"] == str(adapters["qv-down"][0]) and qv["parent"] == "base"
    assert mlp["root"] == str(adapters["k-o-mlp"][0]) and mlp["parent"] == "base"
    assert all(card["object"] == "model" and card["max_model_len"] > 0 for card in cards)
    retrieved = http.get("/v1/models/qv-down").json()
    assert {**retrieved, "created": 0} == {**qv, "created": 0}
    # Anthropic's listing names them too.
    listed = http.get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
    assert [model["id"] for model in listed["data"]] == ["base", "qv-down", "k-o-mlp"]


def test_unknown_model_is_404_listing_what_is_served(lora_server, http):
    reply = http.post("/v1/completions", json={"model": "nope", "prompt": "Hi"})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] == "model_not_found"
    assert "`base`, `qv-down`, `k-o-mlp`" in error["message"]
    assert http.get("/v1/models/nope").status_code == 404


def test_load_use_unload(lora_server, http, adapters, expected):
    client = lora_server.client(api_key=KEY)
    folder = str(adapters["late"][0])
    body = {"lora_name": "late", "lora_path": folder}
    assert httpx.post(f"{lora_server.v1}/load_lora_adapter", json=body).status_code == 401
    loaded = http.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'late' added successfully."
    assert [card["id"] for card in http.get("/v1/models").json()["data"]][-1] == "late"
    assert _completion_ids(client, "late") == ("late", expected["late"])
    again = http.post("/v1/load_lora_adapter", json=body)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    clash = http.post("/v1/load_lora_adapter", json={"lora_name": "base", "lora_path": folder})
    assert clash.status_code == 400

    # A request that started with it (its first tokens out) finishes after the unload.
    stream = client.completions.create(
        model="late", prompt=PROMPT, **GREEDY, extra_body=EXTRA, stream=True
    )
    chunks = [next(stream)]
    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert unloaded.status_code == 200
    assert unloaded.text == "Success: LoRA adapter 'late' removed successfully."
    chunks += list(stream)
    streamed = [
        t for chunk in chunks for c in chunk.model_dump()["choices"] for t in c["token_ids"]
    ]
    assert streamed == expected["late"]
    assert "late" not in [card["id"] for card in http.get("/v1/models").json()["data"]]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=1)
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]


def test_loading_a_bad_adapter_is_400_naming_the_problem(lora_server, http, tiny_llama, tmp_path):
    def load(name: str, path) -> str:
        reply = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert reply.status_code == 400
        return reply.json()["error"]["message"]

    assert "no such folder" in load("missing", tmp_path / "missing")
    big = make_tiny_lora(tiny_llama, tmp_path / "big", rank=16)
    assert "rank 16, above max_lora_rank 8 (--max-lora-rank)" in load("big", big)
    dora = make_tiny_lora(tiny_llama, tmp_path / "dora", use_dora=True)
    assert "DoRA" in load("dora", dora)
    names = [card["id"] for card in http.get("/v1/models").json()["data"]]
    assert not {"missing", "big", "dora"} & set(names)


def test_runtime_routes_are_served_only_where_allowed(lora_server, http, server):
    """vLLM registers them only under VLLM_ALLOW_RUNTIME_LORA_UPDATING: elsewhere, 404."""
    body = {"lora_name": "x", "lora_path": "/nowhere"}
    assert http.post("/v1/load_lora_adapter", json=body).status_code == 400
    unknown = http.post("/v1/unload_lora_adapter", json=body)
    assert (
        unknown.status_code == 404 and "'x' cannot be found" in unknown.json()["error"]["message"]
    )
    for route in ("load_lora_adapter", "unload_lora_adapter"):
        reply = httpx.post(f"{server.v1}/{route}", json=body)
        assert reply.status_code == 404
        assert reply.json()["error"]["message"] == f"No route POST /v1/{route}."


# -- start-up errors --------------------------------------------------------------------


@pytest.fixture
def run_serve(monkeypatch, capsys):
    """`serve ARGV` in this process: (exit status, stderr)."""
    monkeypatch.delenv("SERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    handler = signal.getsignal(signal.SIGTERM)

    def run(*argv: str) -> tuple[int, str]:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            with pytest.raises(SystemExit) as info:
                main([*argv, "--port", str(port), "--kv-cache-memory", "16MiB"])
        finally:
            signal.signal(signal.SIGTERM, handler)
        return info.value.code, capsys.readouterr().err

    return run


def test_lora_modules_mistakes_stop_serve_before_the_model_loads(run_serve, monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine started")

    monkeypatch.setattr("serve.engine.core_client.EngineCoreClient", no_engine)
    code, err = run_serve("--lora-modules", "a=/adapters/a")
    assert code == 1
    assert "serve: error: --lora-modules needs --enable-lora" in err
    code, err = run_serve("--allow-runtime-lora-updating")
    assert code == 1 and "--allow-runtime-lora-updating needs --enable-lora" in err
    code, err = run_serve("--enable-lora", "--lora-modules", "a=/x", "b=/y", "a=/z")
    assert code == 1 and "--lora-modules names ['a'] more than once" in err
    code, err = run_serve("--enable-lora", "--lora-modules", "just-a-path")
    assert code == 2 and "argument --lora-modules: 'just-a-path' is not NAME=PATH" in err
    code, err = run_serve("--enable-lora", "--lora-modules", '{"name": "a", "src": "/x"}')
    assert code == 2 and "unknown fields ['src']" in err


def test_an_adapter_the_engine_refuses_stops_serve_naming_it(run_serve, tiny_llama, tmp_path):
    base = ("--model", str(tiny_llama), "--enable-lora", "--disable-frontend-multiprocessing")
    code, err = run_serve(*base, "--lora-modules", f"bad={tmp_path / 'nothing'}")
    assert code == 1
    assert err.startswith("serve: error: --lora-modules: LoRA adapter 'bad' (")
    assert "no such folder" in err
    adapter = make_tiny_lora(tiny_llama, tmp_path / "a")
    code, err = run_serve(*base, "--served-model-name", "m", "--lora-modules", f"m={adapter}")
    assert code == 1 and "'m' is a name of the served model" in err
