"""`max_tokens: 0` with `echo` on /v1/completions: the prompt scored, nothing sampled
(OpenAI's legacy API; lm-evaluation-harness's loglikelihood requests). The text is the
prompt, the logprobs HF's log-softmax of it, streamed or not; without echo, a 400."""

from __future__ import annotations

import pytest
from api.openai_errors import assert_openai_error
from tiny_models import hf_log_softmax

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time"]
COMPLETIONS = "/v1/completions"


def _scored(server, **fields) -> dict:
    return {"model": server.model, "prompt": PROMPTS, "max_tokens": 0, "echo": True, **fields}


def _assert_hf_logprobs(logprobs: dict, prompt_ids: list[int], tokenizer, tiny_llama) -> None:
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in prompt_ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    reference = hf_log_softmax(tiny_llama, prompt_ids)
    for pos in range(1, len(prompt_ids)):
        expected = reference[pos - 1, prompt_ids[pos]].item()
        assert logprobs["token_logprobs"][pos] == pytest.approx(expected, abs=1e-4), pos
        # The prompt token itself (as OpenAI always gives the chosen token's) and the top
        # alternative, HF's most likely token there.
        top = logprobs["top_logprobs"][pos]
        assert 1 <= len(top) <= 2
        assert top[logprobs["tokens"][pos]] == pytest.approx(expected, abs=1e-4)
        assert max(top.values()) == pytest.approx(reference[pos - 1].max().item(), abs=1e-4)
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets


def test_the_prompt_is_scored_and_nothing_is_generated(http, server, tokenizer, tiny_llama):
    resp = http.post(COMPLETIONS, json=_scored(server, logprobs=1)).json()
    assert [c["index"] for c in resp["choices"]] == [0, 1]
    num_prompt = 0
    for prompt, choice in zip(PROMPTS, resp["choices"], strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        num_prompt += len(prompt_ids)
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
        _assert_hf_logprobs(choice["logprobs"], prompt_ids, tokenizer, tiny_llama)
    assert resp["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 0,
        "total_tokens": num_prompt,
    }


def test_without_logprobs_the_text_is_the_prompt(client, server):
    resp = client.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=0, echo=True)
    (choice,) = resp.choices
    assert choice.text == PROMPTS[1] and choice.logprobs is None
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 0


def test_streamed_it_is_one_chunk_per_prompt(client, server, http):
    whole = http.post(COMPLETIONS, json=_scored(server, logprobs=1)).json()
    chunks = list(
        client.completions.create(
            model=server.model,
            prompt=PROMPTS,
            max_tokens=0,
            echo=True,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *choices, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 0
    assert last.usage.prompt_tokens == whole["usage"]["prompt_tokens"]
    assert sorted(c.choices[0].index for c in choices) == [0, 1]
    for chunk in choices:
        (choice,) = chunk.choices
        expected = whole["choices"][choice.index]
        assert choice.text == expected["text"] and choice.finish_reason == "length"
        got = choice.logprobs
        assert got.tokens == expected["logprobs"]["tokens"]
        assert got.token_logprobs == pytest.approx(expected["logprobs"]["token_logprobs"], abs=1e-5)


def test_a_prompt_as_long_as_the_context_window_is_scored(http, server):
    prompt = [3 + i % 500 for i in range(512)]  # the tiny llama's window
    resp = http.post(COMPLETIONS, json=_scored(server, prompt=prompt, logprobs=0))
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"][0]["logprobs"]["tokens"]) == 512
    error = assert_openai_error(
        http.post(COMPLETIONS, json=_scored(server, prompt=[*prompt, 3])), 400, "prompt"
    )
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"echo": False}, "max_tokens"),
        ({"echo": False, "stream": True}, "max_tokens"),
        ({"n": 2}, "max_tokens"),
        ({"best_of": 2}, "max_tokens"),
    ],
)
def test_what_max_tokens_zero_cannot_do_is_400(http, server, fields, param):
    error = assert_openai_error(http.post(COMPLETIONS, json=_scored(server, **fields)), 400, param)
    assert "max_tokens is 0" in error["message"]
