"""/v1/messages with `--reasoning-parser`: the model's thinking as a `thinking` block before
its answer (streamed: `thinking_delta`s and a `signature_delta`, as vLLM 0.32 sends them),
`thinking` disabled, and thinking blocks sent back in the history.

One server, the tiny llama with `<think>` and `</think>` tokens (test_reasoning.py's) and
the qwen3 parser: for this model's template it reads the output as deepseek_r1 does (all
before `</think>` is thinking), and `thinking: disabled` reaches it as `enable_thinking`
false. The Messages API takes no logit bias, so the question is one, among a few tried,
after which the greedy model writes `</think>` mid-output; what it writes is read from
/v1/completions, which no reasoning parser reads.
"""

from __future__ import annotations

import re

import httpx
import pytest
from api.test_messages import anthropic_client, sse_events
from api.test_reasoning import think_model, written  # noqa: F401  (a fixture)

MAX_TOKENS = 12
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(server_factory, think_model):  # noqa: F811
    return server_factory("--reasoning-parser", "qwen3", model=think_model)


@pytest.fixture(scope="module")
def question(server) -> tuple[list[dict], str, str, int]:
    """Messages after which the greedy model thinks, writes `</think>` and answers: them,
    the thinking, the answer and the number of tokens written."""
    for i in range(100):
        messages = [{"role": "user", "content": f"Question {i}: what is the capital of France?"}]
        raw = written(server, messages, max_tokens=MAX_TOKENS, **GREEDY)
        thought, end, answer = raw["text"].partition("</think>")
        if end and thought.strip() and answer:
            return messages, thought, answer, len(raw["token_ids"])
    pytest.fail("no question makes the tiny model end its thinking mid-output")


def request(server, messages: list[dict], **fields) -> dict:
    return {"model": server.model, "messages": messages, "max_tokens": MAX_TOKENS, **fields}


def test_the_thinking_is_a_block_before_the_answer(server, question):
    messages, thought, answer, num_tokens = question
    message = anthropic_client(server).messages.create(
        **request(server, messages), extra_body=GREEDY
    )
    thinking, text = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", thought)
    assert re.fullmatch(r"[0-9a-f]{32}", thinking.signature)  # vLLM's: a random hex string
    assert (text.type, text.text) == ("text", answer)
    assert message.usage.output_tokens == num_tokens  # the thinking's tokens among them


def test_streamed_thinking_then_text_as_vllm_sends_them(server, question):
    messages, thought, answer, num_tokens = question
    events = sse_events(server, request(server, messages, **GREEDY))
    shape = " ".join(
        data["type"]
        + (f":{data['delta']['type']}" if data["type"] == "content_block_delta" else "")
        for _, data in events
    )
    assert re.fullmatch(
        r"message_start ping content_block_start (content_block_delta:thinking_delta )+"
        r"content_block_delta:signature_delta content_block_stop content_block_start "
        r"(content_block_delta:text_delta )+content_block_stop message_delta message_stop",
        shape,
    ), shape
    blocks = [data for _, data in events if data["type"].startswith("content_block")]
    starts = [data for data in blocks if data["type"] == "content_block_start"]
    assert [(s["index"], s["content_block"]) for s in starts] == [
        (0, {"type": "thinking", "thinking": ""}),
        (1, {"type": "text", "text": ""}),
    ]
    deltas = [data for data in blocks if data["type"] == "content_block_delta"]
    assert [d["index"] for d in deltas] == sorted(d["index"] for d in deltas)
    assert "".join(d["delta"].get("thinking", "") for d in deltas) == thought
    assert "".join(d["delta"].get("text", "") for d in deltas) == answer
    assert events[-2][1]["usage"] == {"output_tokens": num_tokens}

    # The SDK's accumulated message is the non-streamed one, signature aside.
    client = anthropic_client(server)
    with client.messages.stream(**request(server, messages), extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    message = client.messages.create(**request(server, messages), extra_body=GREEDY)
    streamed, whole = final.model_dump(), message.model_dump()
    assert re.fullmatch(r"[0-9a-f]{32}", streamed["content"][0].pop("signature"))
    whole["content"][0].pop("signature")
    assert streamed["content"] == whole["content"]


def test_thinking_disabled_leaves_all_to_the_answer(server, question):
    """`thinking: disabled` is chat's reasoning_effort "none": the template's
    enable_thinking false, after which qwen3's output is all answer."""
    messages, thought, answer, _ = question
    url = f"{server.url}/v1/messages"
    thinks = httpx.post(url, json=request(server, messages, **GREEDY), timeout=60).json()
    assert [block["type"] for block in thinks["content"]] == ["thinking", "text"]
    body = request(server, messages, thinking={"type": "disabled"}, **GREEDY)
    reply = httpx.post(url, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["content"] == [{"type": "text", "text": f"{thought}</think>{answer}"}]


def test_enabled_thinking_is_checked_as_vllm_checks_it(server, question):
    messages = question[0]
    count_url = f"{server.url}/v1/messages/count_tokens"
    plain = httpx.post(count_url, json={"model": server.model, "messages": messages}).json()
    enabled = {"type": "enabled", "budget_tokens": 1024}
    counted = httpx.post(
        count_url, json={"model": server.model, "messages": messages, "thinking": enabled}
    )
    assert counted.status_code == 200 and counted.json() == plain
    # The budget (not enforced: serve has none) must be at least 1024 and below max_tokens.
    for budget, named in ((1024, "less than max_tokens"), (100, "budget_tokens")):
        body = request(server, messages, thinking={"type": "enabled", "budget_tokens": budget})
        reply = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["type"] == "invalid_request_error"
        assert named in reply.json()["error"]["message"]


def test_thinking_blocks_sent_back_are_taken(server, question):
    """A reply's thinking (and a redacted one) sent back in the history is accepted, as
    the assistant's reasoning; in a user's turn, a thinking block is refused by name."""
    messages = question[0]
    reply_blocks = [
        {"type": "thinking", "thinking": "They ask about France.", "signature": "abc"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "text", "text": "Paris."},
    ]
    history = [
        *messages,
        {"role": "assistant", "content": reply_blocks},
        {"role": "user", "content": "And Italy?"},
    ]
    message = anthropic_client(server).messages.create(
        **{**request(server, history), "max_tokens": 2}, extra_body=GREEDY
    )
    assert message.usage.output_tokens == 2

    user_thinking = [{"role": "user", "content": reply_blocks[:1]}]
    reply = httpx.post(f"{server.url}/v1/messages", json=request(server, user_thinking))
    assert reply.status_code == 400
    assert "block 0 is of type 'thinking'" in reply.json()["error"]["message"]
