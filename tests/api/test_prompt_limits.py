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
    error = assert_openai_error(response, 400, "max_tokens")
    assert "in the prompt" in error["message"]


def test_tokenize_refuses_a_text_far_over_the_context_untokenized(http, server):
    """/tokenize shares the thread every chat and completion prompt is tokenized on: 8 MB
    there held up every new request for 20 s."""
    error = assert_openai_error(http.post("/tokenize", json={"prompt": HUGE}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    counted = http.post("/tokenize", json={"prompt": "a b c d " * 2000}).json()
    assert counted["count"] > counted["max_model_len"]  # over the context, still counted
