"""The server answers as the offline `serve.LLM` does: same greedy text, same token counts."""

from __future__ import annotations

import pytest

from serve import LLM, SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a helpful assistant. Be brief."},
        {"role": "user", "content": "Write one sentence about the sea."},
    ],
]
MAX_TOKENS = 16


def assert_server_matches_offline(server, llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    offline = llm.chat(CONVERSATIONS, params, use_tqdm=False)
    client = server.client()
    for conversation, want in zip(CONVERSATIONS, offline):
        got = client.chat.completions.create(
            model=server.model, messages=conversation, temperature=0, max_tokens=MAX_TOKENS
        )
        assert got.choices[0].message.content == want.outputs[0].text
        assert got.choices[0].finish_reason == want.outputs[0].finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_tiny_model_server_matches_offline(server, tiny_llama):
    assert_server_matches_offline(server, LLM(model=str(tiny_llama), kv_cache_memory="8MiB"))


@pytest.mark.slow
def test_default_model_server_matches_offline(server_factory):
    server = server_factory(model=None)  # started without --model
    assert server.model, "the default model has a served name"
    llm = LLM(model=None, kv_cache_memory="64MiB")
    assert_server_matches_offline(server, llm)
    answer = server.client().chat.completions.create(
        model=server.model, messages=CONVERSATIONS[0], temperature=0, max_tokens=MAX_TOKENS
    )
    assert "Paris" in answer.choices[0].message.content
