"""A prompt text that cannot fit the context window is refused on its length in
characters, before it is tokenized (which takes seconds for megabytes)."""

from __future__ import annotations

from api.openai_errors import assert_openai_error

HUGE = "lorem ipsum dolor " * 400_000  # 7.2 M characters


def test_a_completion_prompt_far_over_the_context_is_refused_untokenized(http, server):
    response = http.post("/v1/completions", json={"model": server.model, "prompt": HUGE})
    error = assert_openai_error(response, 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    assert "the prompt has 7200000 characters" in error["message"]


def test_a_chat_far_over_the_context_is_refused_untokenized(http, server):
    messages = [{"role": "user", "content": HUGE}]
    response = http.post("/v1/chat/completions", json={"model": server.model, "messages": messages})
    error = assert_openai_error(response, 400, "messages")
    assert "characters" in error["message"]


def test_a_prompt_within_the_character_bound_is_judged_by_its_tokens(http, server):
    """Over the context in tokens but not absurdly long: tokenized, then refused with the
    token count, as before."""
    response = http.post(
        "/v1/completions", json={"model": server.model, "prompt": "a b c d " * 2000}
    )
    error = assert_openai_error(response, 400, "prompt")
    assert "your prompt resulted in" in error["message"]


def test_tokenize_refuses_a_text_far_over_the_context_untokenized(http, server):
    """/tokenize shares the thread every chat and completion prompt is tokenized on: 8 MB
    there held up every new request for 20 s."""
    error = assert_openai_error(http.post("/tokenize", json={"prompt": HUGE}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    counted = http.post("/tokenize", json={"prompt": "a b c d " * 2000}).json()
    assert counted["count"] > counted["max_model_len"]  # over the context, still counted


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(http, server, tokenizer):
    """vLLM's extra, on completions, chat and embeddings: the last N tokens, or -1 for the
    context's worth. It used to be ignored without a word."""
    ids = tokenizer("The quick brown fox jumps over the lazy dog once more").input_ids
    assert len(ids) > 5
    base = {"model": server.model, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    cut = http.post("/v1/completions", json={**base, "prompt": ids, "truncate_prompt_tokens": 5})
    last = http.post("/v1/completions", json={**base, "prompt": ids[-5:]})
    assert cut.json()["usage"]["prompt_tokens"] == 5
    assert cut.json()["choices"][0]["text"] == last.json()["choices"][0]["text"]

    chat = {**base, "messages": [{"role": "user", "content": "Hi there, how are you?"}]}
    cut = http.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 4})
    assert cut.json()["usage"]["prompt_tokens"] == 4

    # An embedding keeps the input's first tokens, as vLLM's pooling truncates.
    embed = {"model": server.model, "input": ids}
    cut = http.post("/v1/embeddings", json={**embed, "truncate_prompt_tokens": 5}).json()
    first = http.post("/v1/embeddings", json={**embed, "input": ids[:5]}).json()
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["data"][0]["embedding"] == first["data"][0]["embedding"]
    too_long = ids * (1 + 600 // len(ids))  # past the 512-token window: cut to it
    whole = http.post(
        "/v1/embeddings", json={**embed, "input": too_long, "truncate_prompt_tokens": -1}
    )
    assert whole.json()["usage"]["prompt_tokens"] == 512
    # Without max_tokens, completions' default of 16 takes the room the prompt leaves.
    defaulted = http.post(
        "/v1/completions", json={**base, "prompt": too_long[:508], "max_tokens": None}
    )
    assert defaulted.status_code == 200, defaulted.text
    assert defaulted.json()["usage"]["completion_tokens"] <= 4
    # Generating, -1 leaves the output a token of room, as vLLM counts it.
    generated = http.post(
        "/v1/completions",
        json={**base, "prompt": too_long, "max_tokens": 1, "truncate_prompt_tokens": -1},
    )
    assert generated.status_code == 200, generated.text
    assert generated.json()["usage"] == {
        "prompt_tokens": 511,
        "completion_tokens": 1,
        "total_tokens": 512,
    }


def test_truncate_prompt_tokens_and_priority_out_of_range_are_400(http, server):
    base = {"model": server.model, "prompt": "Hi", "max_tokens": 2}
    for value in (0, 513, -2):
        refused = http.post("/v1/completions", json={**base, "truncate_prompt_tokens": value})
        assert_openai_error(refused, 400, "truncate_prompt_tokens")
    for priority in (2**63, -(2**63) - 1):  # vLLM's bound: a 64-bit integer
        refused = http.post("/v1/completions", json={**base, "priority": priority})
        assert_openai_error(refused, 400, "priority")
