"""The model's generation_config.json sampling values stand in for the fields a request
leaves out (vLLM's `--generation-config auto`); `--generation-config vllm` ignores them."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

# Greedy by the model's word, and at most 4 tokens: both visible in any reply.
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
    assert [c.usage.completion_tokens for c in left_out] == [4, 4]  # max_new_tokens caps it
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
            json={"model": server.model, "messages": messages, "max_tokens": 30},
            timeout=60,
        ).json()
        for _ in range(2)
    ]
    for reply in anthropic:
        assert reply["content"][0]["text"] == left_out[0].choices[0].message.content
        assert reply["usage"]["output_tokens"] == 4
    # The request's own value wins over the model's; max_new_tokens still caps it.
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
    assert sampled.usage.completion_tokens == 4 * 4


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
