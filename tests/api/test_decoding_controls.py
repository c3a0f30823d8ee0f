"""Per-request decoding controls over HTTP: logit_bias, min_tokens, allowed_token_ids,
penalties, prompt logprobs and echo, structured output on the tiny model, and the 400s."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from api.openai_errors import assert_openai_error
from tiny_models import hf_log_softmax

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hello!"}]


def completion(server, **fields) -> dict:
    return {"model": server.model, "prompt": PROMPT, "max_tokens": 6, **fields}


def chat(server, **fields) -> dict:
    return {"model": server.model, "messages": MESSAGES, "max_tokens": 6, **fields}


def test_logit_bias_makes_a_token_the_output(client, server, tokenizer):
    token = tokenizer(" fox").input_ids[-1]
    for temperature in (0.0, 1.0):
        resp = client.completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=5,
            temperature=temperature,
            seed=1,
            logit_bias={str(token): 100},
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        assert resp.choices[0].text == tokenizer.decode([token] * 5)
    resp = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=4,
        logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].message.content == tokenizer.decode([token] * 4)


def test_min_tokens_holds_off_eos(client, server, tokenizer):
    eos = str(tokenizer.eos_token_id)
    early = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=10, logit_bias={eos: 100}
    )
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    held = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=10,
        logit_bias={eos: 100},
        extra_body={"min_tokens": 4},
    )
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"


def test_allowed_token_ids_restrict_the_output(http, server, tokenizer):
    allowed = tokenizer(" the sea and the sky").input_ids
    allowed_texts = {tokenizer.decode([t]) for t in allowed}
    body = completion(server, max_tokens=12, temperature=1.5, seed=4, logprobs=0)
    body.update(allowed_token_ids=allowed, ignore_eos=True, n=3)
    resp = http.post("/v1/completions", json=body).json()
    for choice in resp["choices"]:
        tokens = choice["logprobs"]["tokens"]
        assert len(tokens) == 12 and set(tokens) <= allowed_texts, tokens


def test_penalties_change_greedy_output_and_stay_per_request(server):
    """A penalised request changes its own output, not that of a plain one running
    alongside it."""
    plain = completion(server, max_tokens=24, temperature=0, ignore_eos=True)
    penalised = {**plain, "frequency_penalty": 2.0, "presence_penalty": 2.0}

    async def both():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            responses = await asyncio.gather(
                *(http.post("/v1/completions", json=b) for b in (plain, penalised, plain))
            )
        return [r.json()["choices"][0]["text"] for r in responses]

    with httpx.Client(base_url=server.url, timeout=60) as http:
        base = http.post("/v1/completions", json=plain).json()["choices"][0]["text"]
    together = asyncio.run(both())
    assert together[0] == together[2] == base
    assert together[1] != base


def test_echo_with_logprobs_reports_the_prompt_tokens(http, server, tokenizer, tiny_llama):
    body = completion(server, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    prompt_ids = tokenizer(PROMPT).input_ids
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids) + 3
    assert "".join(logprobs["tokens"][: len(prompt_ids)]) == PROMPT
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"][: len(prompt_ids)][0] == 0
    assert logprobs["text_offset"][len(prompt_ids)] == len(PROMPT)
    reference = hf_log_softmax(tiny_llama, prompt_ids)
    for pos in range(1, len(prompt_ids)):
        expected = reference[pos - 1, prompt_ids[pos]].item()
        assert logprobs["token_logprobs"][pos] == pytest.approx(expected, abs=1e-4)


def test_prompt_logprobs_field(http, server, tokenizer, tiny_llama):
    """vLLM's field: per prompt token {logprob, rank, decoded_token} for the prompt token,
    whose rank is HF's count of the tokens at least as likely, then the top one (rank 1),
    in vLLM's order: the prompt token's key first."""
    body = completion(server, max_tokens=1, prompt_logprobs=1)
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    prompt_ids = tokenizer(PROMPT).input_ids
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    reference = hf_log_softmax(tiny_llama, prompt_ids)
    for pos, (token_id, entry) in enumerate(zip(prompt_ids[1:], entries[1:]), start=1):
        assert next(iter(entry)) == str(token_id) and len(entry) in (1, 2)
        assert entry[str(token_id)]["decoded_token"] == tokenizer.decode([token_id])
        assert all(v["logprob"] <= 0 for v in entry.values())
        assert all(list(v) == ["logprob", "rank", "decoded_token"] for v in entry.values())
        assert max(entry.values(), key=lambda v: v["logprob"])["rank"] == 1
        row = reference[pos - 1]
        logprob = row[token_id].item()
        low = int((row > logprob + 1e-4).sum()) + 1
        high = int((row >= logprob - 1e-4).sum())
        assert low <= entry[str(token_id)]["rank"] <= high, pos
    assert any(len(entry) == 2 for entry in entries[1:])  # a prompt token past the top one


def test_guided_choice_and_regex_always_match(http, server):
    choices = ["red", "green", "blue"]
    body = completion(server, max_tokens=8, temperature=1.0, seed=2, n=6, guided_choice=choices)
    resp = http.post("/v1/completions", json=body).json()
    assert {c["text"] for c in resp["choices"]} <= set(choices)
    assert all(c["finish_reason"] == "stop" for c in resp["choices"])
    pattern = r"[a-z]{3,6}@(example|test)\.(com|org)"
    body = completion(server, max_tokens=24, temperature=1.0, seed=3, n=6, guided_regex=pattern)
    resp = http.post("/v1/completions", json=body).json()
    for choice in resp["choices"]:
        assert re.fullmatch(pattern, choice["text"]), choice["text"]


def test_structured_output_streams(client, server):
    stream = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=8,
        stream=True,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("yes", "no")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"allowed_token_ids": [100000]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 2}, "allowed_token_ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"bad_words": [""]}, "bad_words"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, None),
        ({"response_format": {"type": "xml"}}, None),
        ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format.type"),
        # vLLM's fields that serve cannot honour are refused by name, never ignored.
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"logits_processors": ["my.module.Processor"]}, "logits_processors"),
        ({"logits_processors": [], "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"prompt": "", "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ],
)
def test_bad_decoding_controls_are_400(http, server, fields, param):
    error = assert_openai_error(
        http.post("/v1/completions", json=completion(server, **fields)), 400, param
    )
    assert "/project/" not in error["message"]  # no C++ source paths from xgrammar
    # The server keeps serving.
    assert http.post("/v1/completions", json=completion(server)).status_code == 200


def test_max_logprobs_flag(server_factory):
    server = server_factory("--max-logprobs", "2")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.post("/v1/completions", json=completion(server, logprobs=2)).status_code == 200
        assert_openai_error(
            http.post("/v1/completions", json=completion(server, logprobs=3)), 400, "logprobs"
        )
        body = chat(server, logprobs=True, top_logprobs=3)
        assert_openai_error(http.post("/v1/chat/completions", json=body), 400, "top_logprobs")


def test_chat_prompt_logprobs(http, server):
    body = chat(server, max_tokens=1, prompt_logprobs=0)
    resp = http.post("/v1/chat/completions", json=body).json()
    prompt_ids = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    entries = resp["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    assert [list(e) for e in entries[1:]] == [[str(t)] for t in prompt_ids[1:]]
    assert all(e[str(t)]["rank"] >= 1 for t, e in zip(prompt_ids[1:], entries[1:]))


def test_allowed_tokens_all_bad_words_are_400(http, server, tokenizer):
    """A token no bad word bans must remain, or nothing could be generated: a 400 up front,
    not a 500 once the request runs."""
    (spaced,) = tokenizer.encode(" the", add_special_tokens=False)
    body = completion(server, allowed_token_ids=[spaced], bad_words=["the"])
    error = assert_openai_error(http.post("/v1/completions", json=body), 400, "allowed_token_ids")
    assert "bad_words" in error["message"]
