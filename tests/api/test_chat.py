"""POST /v1/chat/completions through the official openai client, sync and async."""

from __future__ import annotations

import asyncio
import re

import pytest
from tiny_models import hf_greedy

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
IGNORE_EOS = {"ignore_eos": True}


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def pick_stop(text: str) -> str:
    """Two ASCII letters or digits from past the text's start: a stop string that is sure
    to be whole characters (the tiny model's text is full of control bytes)."""
    match = re.search(r"[A-Za-z0-9]{2}", text[2:])
    assert match, f"no plain two-character run to stop on in {text!r}"
    return match.group()


def test_greedy_chat_and_usage(client, server, tokenizer, tiny_llama):
    resp = client.chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=0, max_tokens=10, logprobs=True
    )
    assert resp.object == "chat.completion" and resp.model == server.model
    (choice,) = resp.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    prompt_ids = chat_prompt_ids(tokenizer, MESSAGES)
    num_tokens = len(choice.logprobs.content)
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == num_tokens
    assert resp.usage.total_tokens == len(prompt_ids) + num_tokens
    expected = hf_greedy(tiny_llama, prompt_ids, 10)
    assert num_tokens == len(expected)
    assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if expected[-1] == tokenizer.eos_token_id else "length")


def test_streaming_chat_matches_non_streaming(client, server, tokenizer):
    kwargs = dict(model=server.model, messages=MESSAGES, temperature=0, max_tokens=10)
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f] == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert len({c.id for c in chunks}) == 1


def test_max_tokens_gives_length(client, server):
    for limit in ({"max_tokens": 7}, {"max_completion_tokens": 7}):
        resp = client.chat.completions.create(
            model=server.model, messages=MESSAGES, extra_body=IGNORE_EOS, **limit
        )
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.completion_tokens == 7


def test_n_choices(client, server):
    resp = client.chat.completions.create(
        model=server.model, messages=MESSAGES, n=3, max_tokens=8, seed=1, extra_body=IGNORE_EOS
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens == 3 * 8
    assert len({c.message.content for c in resp.choices}) > 1, "samples j use seed + j"

    stream = client.chat.completions.create(
        model=server.model, messages=MESSAGES, n=3, max_tokens=4, stream=True
    )
    finished = sorted(c.choices[0].index for c in stream if c.choices[0].finish_reason)
    assert finished == [0, 1, 2]


def test_stop_string(client, server):
    kwargs = dict(
        model=server.model, messages=MESSAGES, temperature=0, max_tokens=16, extra_body=IGNORE_EOS
    )
    full = client.chat.completions.create(**kwargs)
    full_text = full.choices[0].message.content
    stop = pick_stop(full_text)
    expected = full_text[: full_text.index(stop)]

    cut = client.chat.completions.create(**kwargs, stop=[stop, "never-generated"])
    assert cut.choices[0].message.content == expected
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].stop_reason == stop  # vLLM's extra field

    stream = client.chat.completions.create(**kwargs, stop=stop, stream=True)
    chunks = [c.choices[0] for c in stream]
    assert "".join(c.delta.content or "" for c in chunks) == expected
    assert chunks[-1].finish_reason == "stop"


def test_stop_token_ids(client, server, tokenizer, tiny_llama):
    expected = hf_greedy(tiny_llama, chat_prompt_ids(tokenizer, MESSAGES), 12, ignore_eos=True)
    stop_id = expected[3]
    resp = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        temperature=0,
        max_tokens=12,
        extra_body={"stop_token_ids": [stop_id], "ignore_eos": True},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop_id
    assert resp.usage.completion_tokens == expected.index(stop_id) + 1


@pytest.mark.parametrize("include_stop", [False, True])
def test_eos_text_left_out_even_with_special_tokens(client, server, tokenizer, include_stop):
    """A sequence ended by EOS does not show the EOS token's text, even with
    skip_special_tokens false, unless include_stop_str_in_output (as in vLLM)."""
    eos = tokenizer.eos_token_id
    resp = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        temperature=0,
        max_tokens=8,
        extra_body={
            "min_tokens": 2,
            "logit_bias": {str(eos): 100},  # EOS as soon as min_tokens allows it
            "skip_special_tokens": False,
            "include_stop_str_in_output": include_stop,
        },
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and resp.usage.completion_tokens == 3
    assert choice.message.content.endswith(tokenizer.eos_token) == include_stop


def test_seed_reproducibility(client, server):
    def sample(seed: int) -> str:
        resp = client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,
            temperature=1.0,
            max_tokens=16,
            seed=seed,
            extra_body=IGNORE_EOS,
        )
        return resp.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert sample(1235) != first


def test_logprobs(client, server):
    resp = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body=IGNORE_EOS,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert isinstance(entry.token, str) and entry.bytes
        if "\ufffd" not in entry.token:  # a whole character or more: its UTF-8
            assert entry.bytes == list(entry.token.encode())
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        top = [t.logprob for t in entry.top_logprobs]
        assert top == sorted(top, reverse=True) and all(lp <= 0 for lp in top)
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(top[0], abs=1e-6)
        assert entry.token == entry.top_logprobs[0].token

    plain = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("text", ["😀🎉 naïve", "日本語"])
def test_logprob_bytes_of_tokens_that_split_a_character(tokenizer, text):
    """A token holding part of a character reads as U+FFFD; its `bytes` are the bytes it
    holds, so a client joining them gets the text back (OpenAI's reason for the field)."""
    from serve.api.logprobs_json import token_bytes, token_text

    ids = tokenizer(text, add_special_tokens=False).input_ids
    texts = [token_text(tokenizer, i) for i in ids]
    assert any("\ufffd" in t for t in texts), "the tiny vocabulary should split these"
    joined = b"".join(bytes(token_bytes(tokenizer, i, t)) for i, t in zip(ids, texts))
    assert joined.decode("utf-8") == tokenizer.decode(ids)


def test_async_client(server):
    async def run() -> tuple[str, str]:
        async with server.async_client() as aclient:
            kwargs = dict(model=server.model, messages=MESSAGES, temperature=0, max_tokens=8)
            resp = await aclient.chat.completions.create(**kwargs)
            stream = await aclient.chat.completions.create(**kwargs, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            return resp.choices[0].message.content, text

    full, streamed = asyncio.run(run())
    assert full == streamed


def test_echo_puts_the_continued_message_first(client, server):
    """vLLM's `echo`: a reply that continues the last message (its role is the reply's)
    starts with that message's text, streamed or not; after a user turn nothing is echoed."""
    prefill = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    common = {"model": server.model, "temperature": 0, "max_tokens": 6, "n": 2}
    continued = {"add_generation_prompt": False, "continue_final_message": True, **IGNORE_EOS}
    plain = client.chat.completions.create(messages=prefill, extra_body=continued, **common)
    echoed = client.chat.completions.create(
        messages=prefill, extra_body={**continued, "echo": True}, **common
    )
    for before, after in zip(plain.choices, echoed.choices):
        assert after.message.content == "The capital is" + before.message.content
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    stream = client.chat.completions.create(
        messages=prefill, extra_body={**continued, "echo": True}, stream=True, **common
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in echoed.choices]
    # After a user turn the reply starts a new message: nothing to echo.
    fresh = {"model": server.model, "messages": MESSAGES, "temperature": 0, "max_tokens": 6}
    assert (
        client.chat.completions.create(**fresh, extra_body={"echo": True})
        .choices[0]
        .message.content
        == client.chat.completions.create(**fresh).choices[0].message.content
    )


def test_return_token_ids_gives_the_prompt_and_output_ids(client, server, tokenizer, tiny_llama):
    """vLLM's `return_token_ids`: the prompt's ids beside the choices, each choice's ids;
    streamed, each chunk's new ids and the prompt's on the first chunk."""
    fields = {"model": server.model, "messages": MESSAGES, "temperature": 0, "max_tokens": 6}
    extra = {"return_token_ids": True, **IGNORE_EOS}
    body = client.chat.completions.create(**fields, extra_body=extra).model_dump()
    prompt_ids = chat_prompt_ids(tokenizer, MESSAGES)
    assert body["prompt_token_ids"] == prompt_ids
    (choice,) = body["choices"]
    assert choice["token_ids"] == hf_greedy(tiny_llama, prompt_ids, 6)
    chunks = [
        c.model_dump()
        for c in client.chat.completions.create(**fields, extra_body=extra, stream=True)
    ]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    # With n > 1, each choice's first chunk carries them, as vLLM's role chunks do.
    two = client.chat.completions.create(**fields, n=2, extra_body=extra, stream=True)
    firsts = [c.model_dump() for c in two][:2]
    assert [(c["choices"][0]["index"], c["prompt_token_ids"]) for c in firsts] == [
        (0, prompt_ids),
        (1, prompt_ids),
    ]
    streamed = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert streamed == choice["token_ids"]
    # Not asked for: not there.
    plain = client.chat.completions.create(**fields).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
