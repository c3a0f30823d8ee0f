"""POST /v1/completions through the official openai client, sync and async."""

from __future__ import annotations

import asyncio
import re

import pytest
from tiny_models import hf_greedy

PROMPT = "The quick brown fox"
OTHER_PROMPT = "Once upon a time"
IGNORE_EOS = {"ignore_eos": True}


def greedy(client, server, prompt, max_tokens=8, **kwargs):
    return client.completions.create(
        model=server.model, prompt=prompt, temperature=0, max_tokens=max_tokens, **kwargs
    )


def test_greedy_completion_and_usage(client, server, tokenizer, tiny_llama):
    resp = greedy(client, server, PROMPT, max_tokens=10, extra_body=IGNORE_EOS)
    assert resp.object == "text_completion" and resp.model == server.model
    (choice,) = resp.choices
    prompt_ids = tokenizer(PROMPT).input_ids
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == 10
    assert resp.usage.total_tokens == len(prompt_ids) + 10
    assert choice.finish_reason == "length"
    expected = hf_greedy(tiny_llama, prompt_ids, 10, ignore_eos=True)
    assert choice.text == tokenizer.decode(expected)


def test_streaming_completion_matches_non_streaming(client, server):
    full = greedy(client, server, PROMPT, max_tokens=10)
    chunks = list(
        client.completions.create(
            model=server.model,
            prompt=PROMPT,
            temperature=0,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f] == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_default_max_tokens_is_16(client, server):
    resp = client.completions.create(model=server.model, prompt=PROMPT, extra_body=IGNORE_EOS)
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"


def test_n_choices(client, server):
    resp = client.completions.create(
        model=server.model, prompt=PROMPT, n=3, max_tokens=6, seed=3, extra_body=IGNORE_EOS
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens == 18
    assert len({c.text for c in resp.choices}) > 1


def test_n_samples_equal_single_requests_with_derived_seeds(client, server):
    """One request with n samples shares the prompt's KV; sample i is seeded seed + i."""
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=6, extra_body=IGNORE_EOS)
    together = client.completions.create(n=3, seed=11, **kwargs)
    alone = [client.completions.create(seed=11 + i, **kwargs).choices[0].text for i in range(3)]
    assert [c.text for c in together.choices] == alone


def test_best_of_returns_the_most_likely_samples(client, server):
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=5, seed=5, extra_body=IGNORE_EOS)
    four = client.completions.create(n=4, logprobs=0, **kwargs).choices
    ranked = sorted(four, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    best = client.completions.create(n=2, best_of=4, **kwargs)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert best.usage.completion_tokens == 10


def test_beam_search_equals_hf(client, server, tokenizer, tiny_llama):
    import torch
    import transformers

    prompt_ids = tokenizer(PROMPT).input_ids
    resp = client.completions.create(
        model=server.model,
        prompt=prompt_ids,
        n=2,
        max_tokens=6,
        logprobs=1,
        extra_body={"use_beam_search": True, "best_of": 3, **IGNORE_EOS},
    )
    for choice in resp.choices:  # each beam's tokens with their logprobs
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
        for token, lp, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
            assert lp <= 0 and top[token] == pytest.approx(lp) and 1 <= len(top) <= 2
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    hf = model.generate(
        torch.tensor([prompt_ids]),
        num_beams=3,
        num_return_sequences=2,
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=[],
        pad_token_id=1,  # unused: no beam ends early; HF needs one without an EOS
    )
    expected = [tokenizer.decode(row[len(prompt_ids) :]) for row in hf.tolist()]
    assert [c.text for c in resp.choices] == expected
    assert [c.finish_reason for c in resp.choices] == ["length", "length"]


def test_stop_string_and_token_ids(client, server, tokenizer, tiny_llama):
    full = greedy(client, server, PROMPT, max_tokens=16, extra_body=IGNORE_EOS).choices[0].text
    match = re.search(r"[A-Za-z0-9]{2}", full[2:])
    assert match, f"no plain two-character run to stop on in {full!r}"
    stop = match.group()
    cut = greedy(client, server, PROMPT, max_tokens=16, stop=stop, extra_body=IGNORE_EOS)
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"

    expected = hf_greedy(tiny_llama, tokenizer(PROMPT).input_ids, 12, ignore_eos=True)
    stop_id = expected[4]
    by_id = greedy(
        client,
        server,
        PROMPT,
        max_tokens=12,
        extra_body={"stop_token_ids": [stop_id], "ignore_eos": True},
    )
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.usage.completion_tokens == expected.index(stop_id) + 1

    # The stop token is counted, but its text is left out unless asked for (as in vLLM).
    # A character that the text leaves incomplete (U+FFFD when decoded) is never sent.
    def text_of(ids):
        return tokenizer.decode(ids).removesuffix("\ufffd")

    before_stop = expected[: expected.index(stop_id)]
    assert by_id.choices[0].text == text_of(before_stop)
    kept = greedy(
        client,
        server,
        PROMPT,
        max_tokens=12,
        extra_body={
            "stop_token_ids": [stop_id],
            "ignore_eos": True,
            "include_stop_str_in_output": True,
        },
    )
    assert kept.choices[0].text == text_of([*before_stop, stop_id])
    with_stop = greedy(
        client,
        server,
        PROMPT,
        max_tokens=16,
        stop=stop,
        extra_body={**IGNORE_EOS, "include_stop_str_in_output": True},
    )
    assert with_stop.choices[0].text == full[: full.index(stop) + len(stop)]


def test_seed_reproducibility(client, server):
    def sample(seed: int) -> str:
        resp = client.completions.create(
            model=server.model, prompt=PROMPT, max_tokens=16, seed=seed, extra_body=IGNORE_EOS
        )
        return resp.choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_logprobs(client, server):
    resp = greedy(client, server, PROMPT, max_tokens=6, logprobs=3, extra_body=IGNORE_EOS)
    logprobs = resp.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 6
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token_logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert token_logprob <= 0
        # keyed by token text: two ids that decode alike share a key
        assert 1 <= len(top) <= 3 and all(lp <= 0 for lp in top.values())
        assert token_logprob == pytest.approx(max(top.values()), abs=1e-6)  # greedy: top-1


def test_text_offsets_walk_the_tokens_streamed_or_not_echoed_or_not(client, server):
    """Each token's text_offset counts the texts of the tokens before it: streamed, the
    text sent so far lags behind the tokens (a stop string's holdback, partial UTF-8
    tokens in the tiny model's output), and the offsets used to follow it; echoed, a
    prompt with multi-byte characters put the output's first offset behind its last."""
    prompt = "Café über naïve € Hello, world!"
    kwargs = dict(max_tokens=16, logprobs=2, stop=["zzzz"], extra_body=IGNORE_EOS)
    for echo in (False, True):
        whole = greedy(client, server, prompt, echo=echo, **kwargs).choices[0].logprobs
        offsets = [0]
        for token in whole.tokens[:-1]:
            offsets.append(offsets[-1] + len(token))
        assert whole.text_offset == offsets, echo  # one walk, the prompt's tokens first
    streamed_tokens, streamed_offsets = [], []
    for chunk in greedy(client, server, prompt, stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed_tokens += chunk.choices[0].logprobs.tokens
            streamed_offsets += chunk.choices[0].logprobs.text_offset
    plain = greedy(client, server, prompt, **kwargs).choices[0].logprobs
    assert streamed_tokens == plain.tokens and len(plain.tokens) == 16
    assert streamed_offsets == plain.text_offset


def test_echo_with_logprobs_streams_as_it_returns(client, server):
    """Streamed, echo with logprobs leads each choice's first chunk with the prompt's text
    and logprobs (as vLLM streams it; it was a 400), so the chunks join to the response
    that is not streamed: the same text, tokens, logprobs and offsets."""
    prompt = "Café über naïve € Hello, world!"
    kwargs = dict(max_tokens=6, echo=True, logprobs=2, n=2, extra_body=IGNORE_EOS)
    whole = greedy(client, server, prompt, **kwargs).choices
    texts, tokens, logprobs, offsets = ([[], []] for _ in range(4))
    for chunk in greedy(client, server, prompt, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index].append(choice.text)
            if choice.logprobs is not None:
                tokens[choice.index] += choice.logprobs.tokens
                logprobs[choice.index] += choice.logprobs.token_logprobs
                offsets[choice.index] += choice.logprobs.text_offset
    for index, choice in enumerate(whole):
        assert choice.text.startswith(prompt) and "".join(texts[index]) == choice.text
        assert texts[index][0].startswith(prompt)  # the echo leads the first chunk
        assert tokens[index] == choice.logprobs.tokens
        assert offsets[index] == choice.logprobs.text_offset
        assert logprobs[index][0] is None  # the prompt's first token has none
        assert logprobs[index][1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)


def test_labels_of_split_characters_join_to_the_text(client, server, http):
    """A character split over several byte tokens is labelled as vLLM labels it: "" on
    its first pieces, the whole character on the piece that completes it. So the labels
    join to the text and each text_offset points at its token in it (each piece's own
    U+FFFD put every later offset past the text); prompt_logprobs' decoded_token alike."""
    prompt = "Emoji: 🎉 🚀 😀 🐍, Héllo 世界, naïve € fox"
    for stream in (False, True):
        chunks = greedy(client, server, prompt, max_tokens=0, echo=True, logprobs=1, stream=stream)
        choice = next(iter(chunks)).choices[0] if stream else chunks.choices[0]
        tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
        assert "\ufffd" not in "".join(tokens) and "".join(tokens) == prompt == choice.text
        assert [prompt[o : o + len(t)] for t, o in zip(tokens, offsets)] == tokens
        assert "" in tokens  # the prompt has split characters: their first pieces
    body = {"model": server.model, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0}
    (choice,) = http.post("/v1/completions", json=body).json()["choices"]
    prompt_ids = [int(next(iter(e))) for e in choice["prompt_logprobs"][1:]]
    texts = [
        entry[str(t)]["decoded_token"]
        for t, entry in zip(prompt_ids, choice["prompt_logprobs"][1:])
    ]
    assert tokens[0] + "".join(texts) == prompt


@pytest.mark.parametrize("num_top", [0, 1])
def test_top_logprobs_hold_the_sampled_token(client, server, num_top):
    """OpenAI's legacy API always gives the sampled token's logprob among the top ones, so
    an entry has up to logprobs + 1 keys: with logprobs 0, the sampled token alone."""
    resp = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.5,
        seed=11,
        logprobs=num_top,
        extra_body=IGNORE_EOS,
    )
    logprobs = resp.choices[0].logprobs
    entries = zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)
    for token, token_logprob, top in entries:
        assert top[token] == pytest.approx(token_logprob)
        assert 1 <= len(top) <= num_top + 1
    if num_top == 0:
        assert all(len(top) == 1 for top in logprobs.top_logprobs)
    else:  # hot sampling picks something other than the best at some position
        assert any(len(top) == 2 for top in logprobs.top_logprobs)


def test_echo(client, server):
    plain = greedy(client, server, PROMPT, max_tokens=4).choices[0].text
    echoed = greedy(client, server, PROMPT, max_tokens=4, echo=True).choices[0].text
    assert echoed == PROMPT + plain
    stream = client.completions.create(
        model=server.model, prompt=PROMPT, temperature=0, max_tokens=4, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == PROMPT + plain


def test_prompt_forms(client, server, tokenizer):
    by_text = greedy(client, server, PROMPT).choices[0].text
    other = greedy(client, server, OTHER_PROMPT).choices[0].text
    ids, other_ids = tokenizer(PROMPT).input_ids, tokenizer(OTHER_PROMPT).input_ids

    assert greedy(client, server, ids).choices[0].text == by_text

    two = greedy(client, server, [PROMPT, OTHER_PROMPT])
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [by_text, other]
    assert two.usage.prompt_tokens == len(ids) + len(other_ids)

    # choice i*n + j is sample j of prompt i
    four = greedy(client, server, [ids, other_ids], n=2)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert [c.text for c in four.choices] == [by_text, by_text, other, other]
    assert four.usage.prompt_tokens == len(ids) + len(other_ids)


def test_async_client(server):
    async def run() -> tuple[str, str]:
        async with server.async_client() as aclient:
            kwargs = dict(model=server.model, prompt=PROMPT, temperature=0, max_tokens=8)
            resp = await aclient.completions.create(**kwargs)
            stream = await aclient.completions.create(**kwargs, stream=True)
            text = "".join([c.choices[0].text async for c in stream])
            return resp.choices[0].text, text

    full, streamed = asyncio.run(run())
    assert full == streamed


def test_return_token_ids_per_choice_streamed_or_not(client, server, tokenizer):
    prompts = ["The quick brown fox", "Hello there"]
    fields = dict(model=server.model, prompt=prompts, max_tokens=5, n=2, temperature=1.0, seed=3)
    extra = {"return_token_ids": True, **IGNORE_EOS}
    whole = client.completions.create(**fields, extra_body=extra).model_dump()["choices"]
    for choice in whole:
        prompt = prompts[choice["index"] // 2]
        assert choice["prompt_token_ids"] == tokenizer(prompt).input_ids
        assert len(choice["token_ids"]) == 5
    streamed: dict[int, list[int]] = {}
    firsts: dict[int, list[int]] = {}
    for chunk in client.completions.create(**fields, extra_body=extra, stream=True):
        for choice in chunk.model_dump()["choices"]:
            if "prompt_token_ids" in choice:
                assert choice["index"] not in firsts  # on a choice's first chunk alone
                firsts[choice["index"]] = choice["prompt_token_ids"]
            streamed.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert firsts == {c["index"]: c["prompt_token_ids"] for c in whole}
    assert streamed == {c["index"]: c["token_ids"] for c in whole}
