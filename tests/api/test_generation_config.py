"""The model's generation_config.json sampling values stand in for the fields a request
leaves out (vLLM's `--generation-config auto`); `--generation-config vllm` ignores them, a
folder's file replaces them, `--override-generation-config` goes over them. Its
max_new_tokens is the budget of a request that sets none; only a folder's, or the
override's, caps every request (vLLM 0.32's rules)."""

from __future__ import annotations

import json
import shutil
import signal

import httpx
import pytest

# Greedy by the model's word, and 4 tokens when max_tokens is left out: both visible in
# any reply.
MODEL_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 4, "top_k": 20, "do_sample": True}


@pytest.fixture(scope="module")
def opinionated_model(tiny_llama, tmp_path_factory):
    model = tmp_path_factory.mktemp("gencfg") / "tiny-llama"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, **MODEL_DEFAULTS}))
    return model


def test_requests_that_leave_a_field_out_take_the_models_value(server_factory, opinionated_model):
    server = server_factory(model=opinionated_model)
    client = server.client()
    messages = [{"role": "user", "content": "Tell me a story."}]
    left_out = [
        client.chat.completions.create(model=server.model, messages=messages) for _ in range(2)
    ]
    assert [c.usage.completion_tokens for c in left_out] == [4, 4]  # max_new_tokens
    assert left_out[0].choices[0].message.content == left_out[1].choices[0].message.content
    greedy = client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=4
    )
    assert greedy.choices[0].message.content == left_out[0].choices[0].message.content
    as_none = client.chat.completions.create(
        model=server.model, messages=messages, temperature=None
    )
    assert as_none.choices[0].message.content == left_out[0].choices[0].message.content
    # Anthropic's Messages too: temperature left out is the model's, not Anthropic's 1.0.
    anthropic = [
        httpx.post(
            f"{server.url}/v1/messages",
            json={"model": server.model, "messages": messages, "max_tokens": 4},
            timeout=60,
        ).json()
        for _ in range(2)
    ]
    for reply in anthropic:
        assert reply["content"][0]["text"] == left_out[0].choices[0].message.content
        assert reply["usage"]["output_tokens"] == 4
    # The request's own values win over the model's, max_tokens too: it is no cap.
    longer = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert longer.usage.completion_tokens == 6
    assert longer.choices[0].message.content.startswith(left_out[0].choices[0].message.content)
    sampled = client.completions.create(
        model=server.model,
        prompt="Once",
        temperature=1.0,
        max_tokens=30,
        n=4,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert len({c.text for c in sampled.choices}) > 1  # sampled, not the model's greedy
    assert sampled.usage.completion_tokens == 4 * 30
    # Completions' own default of 16 comes first, as in vLLM: max_new_tokens is not asked.
    defaulted = client.completions.create(
        model=server.model, prompt="Once", extra_body={"ignore_eos": True}
    )
    assert defaulted.usage.completion_tokens == 16


def test_override_goes_over_the_models_and_its_max_new_tokens_caps(
    server_factory, opinionated_model
):
    server = server_factory(
        "--override-generation-config",
        '{"max_new_tokens": 3, "top_k": null}',
        model=opinionated_model,
    )
    client = server.client()
    messages = [{"role": "user", "content": "Tell me a story."}]
    ignore_eos = {"ignore_eos": True}
    left_out = client.chat.completions.create(
        model=server.model, messages=messages, extra_body=ignore_eos
    )
    assert left_out.usage.completion_tokens == 3  # the override's, over the model's 4
    for asked in (2, 6):  # a cap, not only a default
        capped = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=asked, extra_body=ignore_eos
        )
        assert capped.usage.completion_tokens == min(asked, 3)
    completion = client.completions.create(model=server.model, prompt="Once", extra_body=ignore_eos)
    assert completion.usage.completion_tokens == 3  # completions' 16, capped
    # The model's temperature 0 still stands (the override sets none): greedy.
    greedy = client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, extra_body=ignore_eos
    )
    assert greedy.choices[0].message.content == left_out.choices[0].message.content


def test_a_generation_config_folder_replaces_the_models_and_caps(
    server_factory, tiny_llama, tmp_path_factory
):
    folder = tmp_path_factory.mktemp("gencfg-folder")
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5}))
    server = server_factory("--generation-config", str(folder), model=tiny_llama)
    client = server.client()
    messages = [{"role": "user", "content": "Tell me a story."}]
    ignore_eos = {"ignore_eos": True}
    for asked in (None, 9):
        reply = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=asked, extra_body=ignore_eos
        )
        assert reply.usage.completion_tokens == 5


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--generation-config", "{tmp}"), "a folder holding generation_config.json"),
        (("--generation-config", "{tmp}/bad"), "cannot be read"),
        (("--override-generation-config", '{"temperature": '), "is not valid JSON"),
        (("--override-generation-config", '{"presence_penalty": 1}'), "presence_penalty"),
        (("--override-generation-config", '{"max_new_tokens": 0}'), "positive integer"),
        # In range, as a request's: it was taken, then every request that left the field
        # out got a 400 blaming it.
        (("--override-generation-config", '{"temperature": -1}'), "temperature must be"),
        (("--override-generation-config", '{"top_k": -7}'), "top_k"),
        (("--generation-config", "{tmp}/hot"), "top_p"),
    ],
)
def test_a_bad_generation_config_is_a_start_up_error(tiny_llama, tmp_path, capsys, flags, words):
    from serve.api.cli import main

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "generation_config.json").write_text("{not json")
    (tmp_path / "hot").mkdir()
    (tmp_path / "hot" / "generation_config.json").write_text('{"top_p": 1.5}')
    argv = ["--model", str(tiny_llama), *(f.replace("{tmp}", str(tmp_path)) for f in flags)]
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as info:
            main(argv)
    finally:
        signal.signal(signal.SIGTERM, handler)  # main() installs its own
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flags[0]}: " in err and words in err


def test_generation_config_vllm_ignores_them(server_factory, opinionated_model):
    server = server_factory("--generation-config", "vllm", model=opinionated_model)
    reply = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=9,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage.completion_tokens == 9


def test_offline_defaults_are_the_models(opinionated_model):
    from serve import LLM, SamplingParams

    llm = LLM(model=str(opinionated_model), kv_cache_memory="8MiB")
    assert llm.get_default_sampling_params() == SamplingParams(
        temperature=0.0, max_tokens=4, top_k=20
    )
    (out,) = llm.generate("Once upon a time", use_tqdm=False)
    assert len(out.outputs[0].token_ids) <= 4
    llm.shutdown()
    neutral = LLM(model=str(opinionated_model), kv_cache_memory="8MiB", generation_config="vllm")
    assert neutral.get_default_sampling_params() == SamplingParams()
    neutral.shutdown()


def test_offline_takes_a_folder_and_an_override(opinionated_model, tmp_path):
    """As vLLM's `LLM(generation_config=..., override_generation_config=...)`: the
    defaults of `generate` without SamplingParams (offline, max_new_tokens caps nothing)."""
    from serve import LLM, SamplingParams

    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "top_k": 7}))
    llm = LLM(
        model=str(opinionated_model),
        kv_cache_memory="8MiB",
        generation_config=str(tmp_path),
        override_generation_config={"max_new_tokens": 3, "top_k": None, "temperature": 0.0},
    )
    assert llm.get_default_sampling_params() == SamplingParams(
        temperature=0.0, top_p=0.5, max_tokens=3
    )
    llm.shutdown()
