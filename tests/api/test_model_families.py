"""The server serves a model of each attention kind through the openai client: ALiBi
(BLOOM), a sliding window crossed by the context (Mistral), and mixture-of-experts
(Mixtral). Streamed and whole completions carry HF transformers' greedy tokens."""

from __future__ import annotations

import pytest
from api.conftest import start_server, stop_process
from model_families import FAMILIES_BY_KEY
from tiny_models import hf_greedy, random_prompts

from serve.engine.detokenizer import IncrementalDetokenizer

KINDS = {"alibi": "bloom", "sliding-window": "mistral", "moe": "mixtral"}
MAX_TOKENS = 16


@pytest.fixture
def family_server(tiny_model_factory, tmp_path):
    """`(family key) -> Server`, stopped at the end of the test: unlike server_factory's
    session-long servers, three more model servers need not hold memory for the rest of
    the suite."""
    servers = []

    def start(key: str):
        model_dir = tiny_model_factory(key)
        servers.append(start_server(model_dir, ("--max-num-batched-tokens", "16"), {}, tmp_path))
        return model_dir, servers[-1]

    yield start
    for server in servers:
        stop_process(server.process)


@pytest.mark.parametrize("kind", KINDS.keys())
def test_server_answers_with_hf_greedy_tokens(family_server, kind):
    from transformers import AutoTokenizer

    model_dir, server = family_server(FAMILIES_BY_KEY[KINDS[kind]].key)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    client = server.client()
    # Long enough to cross the tiny models' windows and to be prefilled in chunks.
    prompts = random_prompts(512, 3, 20, 48, seed=4)
    for i, prompt in enumerate(prompts):
        expected = _as_served(tokenizer, prompt, hf_greedy(model_dir, prompt, MAX_TOKENS, True))
        reply = client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].text == expected, f"prompt {i}"
        assert reply.usage.completion_tokens == MAX_TOKENS
        stream = client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(c.choices[0].text for c in stream) == expected, f"prompt {i}, streamed"

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
    expected_ids = hf_greedy(model_dir, prompt_ids, MAX_TOKENS)  # stops after EOS, as the chat
    chat = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
    )
    assert chat.choices[0].message.content == _as_served(tokenizer, prompt_ids, expected_ids)


def _as_served(tokenizer, prompt: list[int], output: list[int]) -> str:
    """The text the server streams for these output tokens: decoded as they arrive, in the
    prompt's context (a token may complete a character the prompt began)."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    return "".join(detokenizer.update(output[: i + 1]) for i in range(len(output)))
