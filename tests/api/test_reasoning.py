"""`--reasoning-parser` on a server: a reasoning model's thinking read apart from its answer
on /v1/chat/completions (streamed and not, n > 1, tool calls after it, a grammar that
holds only the answer) and /v1/responses (a reasoning item first), and the flag refused
at start-up where it cannot work.

The tiny llama here has `<think>` and `</think>` as tokens of its tokenizer; a logit bias
on `</think>` makes it end its "thinking" after a few tokens. What it writes is read from
/v1/completions (which no reasoning parser reads) for the same prompt, greedy: the
reasoning is what comes before `</think>`, the answer what comes after.
"""

from __future__ import annotations

import copy
import json
import shutil
import signal

import httpx
import jsonschema
import pytest
from api.conftest import free_port

from serve.api.cli import main

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
}


@pytest.fixture(scope="module")
def think_model(tiny_model_factory, tmp_path_factory):
    """The tiny llama (with room for the tools' system block) and a tokenizer that has
    `<think>` and `</think>` (ids 512 and 513), as reasoning models' tokenizers have them."""
    from tiny_models import build_tokenizer

    base = tiny_model_factory("llama", vocab_size=514, max_position_embeddings=2048)
    out = tmp_path_factory.mktemp("tiny-think")
    shutil.copytree(base, out, dirs_exist_ok=True)
    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.add_tokens(["<think>", "</think>"])
    assert len(tokenizer) == 514
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(server_factory, think_model):
    return server_factory(
        "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes", model=think_model
    )


@pytest.fixture(scope="module")
def end_id(think_model) -> str:
    from transformers import AutoTokenizer

    return str(AutoTokenizer.from_pretrained(think_model).convert_tokens_to_ids("</think>"))


def written(server, messages: list[dict], chat: dict | None = None, **sampling) -> dict:
    """What the model writes for the chat prompt of `messages` (and `chat`'s tools),
    read raw from /v1/completions: its text and token ids."""
    prompt = httpx.post(
        f"{server.url}/tokenize", json={"messages": messages, **(chat or {})}, timeout=30
    ).json()["tokens"]
    body = {"model": server.model, "prompt": prompt, "return_token_ids": True, **sampling}
    reply = httpx.post(f"{server.v1}/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


_biases: dict[str, dict] = {}  # thinking_bias's, by its prompt


def thinking_bias(server, end_id: str, messages: list[dict], chat: dict | None = None) -> dict:
    """A logit bias on `</think>` under which the greedy model thinks for a few tokens and
    then answers: the text has some reasoning, `</think>`, and something after it."""
    key = json.dumps([server.url, messages, chat])
    for bias in () if key in _biases else (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 20):
        logit_bias = {end_id: bias}
        text = written(server, messages, chat, max_tokens=12, logit_bias=logit_bias, **GREEDY)
        head, end, tail = text["text"].partition("</think>")
        if end and head.strip() and tail:
            _biases[key] = logit_bias
            break
    if key not in _biases:
        pytest.fail("no bias makes the tiny model end its thinking mid-output")
    return _biases[key]


def accumulate(chunks) -> dict[int, dict]:
    """Each choice's streamed reasoning, content and order of delta kinds."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            choice = choices.setdefault(c.index, {"reasoning": "", "content": "", "kinds": []})
            delta = c.delta.model_dump()
            for kind in ("reasoning", "content"):
                if delta.get(kind):
                    choice[kind] += delta[kind]
                    choice["kinds"].append(kind)
            if c.finish_reason is not None:
                choice["finish_reason"] = c.finish_reason
    return choices


# --- chat completions ---------------------------------------------------------------------


def test_chat_reads_the_reasoning_apart_from_the_answer(server, end_id):
    client = server.client()
    bias = thinking_bias(server, end_id, QUESTION)
    kwargs = dict(max_tokens=12, logit_bias=bias, **GREEDY)
    raw = written(server, QUESTION, **kwargs)
    thought, _, answer = raw["text"].partition("</think>")

    reply = client.chat.completions.create(model=server.model, messages=QUESTION, **kwargs)
    message = reply.choices[0].message
    assert (message.reasoning, message.content) == (thought, answer)
    assert "reasoning_content" not in message.model_dump()  # vLLM 0.32's name only
    # Usage counts every token, and the reasoning's apart: those before </think>.
    assert reply.usage.completion_tokens == len(raw["token_ids"])
    num_reasoning = raw["token_ids"].index(int(end_id))
    assert reply.usage.completion_tokens_details.reasoning_tokens == num_reasoning

    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=QUESTION,
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,
        )
    )
    (streamed,) = accumulate(chunks).values()
    assert (streamed["reasoning"], streamed["content"]) == (thought, answer)
    kinds = streamed["kinds"]
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # thinking, then answer
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == num_reasoning


def test_an_output_that_never_ends_its_thinking_is_all_reasoning(server, end_id):
    kwargs = dict(max_tokens=8, logit_bias={end_id: -100}, **GREEDY)
    raw = written(server, QUESTION, **kwargs)
    client = server.client()
    message = (
        client.chat.completions.create(model=server.model, messages=QUESTION, **kwargs)
        .choices[0]
        .message
    )
    assert (message.reasoning, message.content) == (raw["text"], None)
    chunks = client.chat.completions.create(
        model=server.model, messages=QUESTION, stream=True, **kwargs
    )
    (streamed,) = accumulate(chunks).values()
    assert (streamed["reasoning"], streamed["content"]) == (raw["text"], "")


def test_each_choice_is_read_on_its_own(server, end_id):
    bias = thinking_bias(server, end_id, QUESTION)
    kwargs = dict(max_tokens=12, logit_bias=bias, n=3, seed=7, temperature=0.8)
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}).json()["tokens"]
    raw = httpx.post(
        f"{server.v1}/completions", json={"model": server.model, "prompt": prompt, **kwargs}
    ).json()
    expected = {}
    for choice in raw["choices"]:
        thought, end, answer = choice["text"].partition("</think>")
        expected[choice["index"]] = (thought, answer if end else None)
    client = server.client()
    reply = client.chat.completions.create(model=server.model, messages=QUESTION, **kwargs)
    assert {c.index: (c.message.reasoning, c.message.content) for c in reply.choices} == expected
    chunks = client.chat.completions.create(
        model=server.model, messages=QUESTION, stream=True, **kwargs
    )
    streamed = {i: (c["reasoning"], c["content"] or None) for i, c in accumulate(chunks).items()}
    assert streamed == expected


def test_include_reasoning_false_leaves_it_out(server, end_id):
    bias = thinking_bias(server, end_id, QUESTION)
    kwargs = dict(max_tokens=12, logit_bias=bias, logprobs=True, **GREEDY)
    answer = written(server, QUESTION, **kwargs)["text"].partition("</think>")[2]
    extra = {"include_reasoning": False}
    client = server.client()
    choice = client.chat.completions.create(
        model=server.model, messages=QUESTION, extra_body=extra, **kwargs
    ).choices[0]
    assert (choice.message.reasoning, choice.message.content) == (None, answer)
    assert choice.logprobs is None  # vLLM's: no token of the reasoning shows
    chunks = client.chat.completions.create(
        model=server.model, messages=QUESTION, stream=True, extra_body=extra, **kwargs
    )
    (streamed,) = accumulate(chunks).values()
    assert (streamed["reasoning"], streamed["content"]) == ("", answer)


def test_tool_calls_are_read_from_the_answer(server, end_id):
    """The thinking is free; after </think> a grammar (guided_choice) makes the model
    write a hermes call, which is read from the content alone."""
    tools = {"tools": [WEATHER_TOOL]}
    bias = thinking_bias(server, end_id, QUESTION, tools)
    thought = written(server, QUESTION, tools, max_tokens=12, logit_bias=bias, **GREEDY)
    thought = thought["text"].partition("</think>")[0]
    kwargs = dict(
        messages=QUESTION, max_tokens=80, logit_bias=bias, extra_body={"guided_choice": [CALL]}
    )
    client = server.client()
    choice = client.chat.completions.create(model=server.model, **tools, **kwargs, **GREEDY)
    choice = choice.choices[0]
    assert choice.message.reasoning == thought
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    chunks = client.chat.completions.create(
        model=server.model, stream=True, **tools, **kwargs, **GREEDY
    )
    reasoning, calls, finish = "", [], None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        reasoning += delta.model_dump().get("reasoning") or ""
        assert not delta.content
        calls += [(c.function.name, c.function.arguments) for c in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == thought and finish == "tool_calls"
    assert calls[0][0] == "get_weather"
    assert json.loads("".join(arguments for _, arguments in calls)) == {"city": "Paris"}


def test_a_grammar_holds_only_the_answer(server, end_id):
    """The reasoning is the unconstrained model's text; the answer follows the schema. A
    prompt that already ended the thinking (a continued `<think>…</think>`) is all answer,
    constrained from its first token."""
    bias = thinking_bias(server, end_id, QUESTION)
    thought = written(server, QUESTION, max_tokens=12, logit_bias=bias, **GREEDY)
    thought = thought["text"].partition("</think>")[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    client = server.client()
    kwargs = dict(model=server.model, max_tokens=60, logit_bias=bias, response_format=fmt)
    choice = client.chat.completions.create(messages=QUESTION, **kwargs, **GREEDY).choices[0]
    assert choice.message.reasoning == thought
    jsonschema.validate(json.loads(choice.message.content), CITY)
    assert choice.finish_reason == "stop"
    chunks = client.chat.completions.create(messages=QUESTION, stream=True, **kwargs, **GREEDY)
    (streamed,) = accumulate(chunks).values()
    assert (streamed["reasoning"], streamed["content"]) == (thought, choice.message.content)

    thought_out = [*QUESTION, {"role": "assistant", "content": "<think>Easy.</think>"}]
    choice = client.chat.completions.create(
        messages=thought_out,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
        **kwargs,
        **GREEDY,
    ).choices[0]
    assert choice.message.reasoning is None
    jsonschema.validate(json.loads(choice.message.content), CITY)

    # include_reasoning false: the grammar holds the output from its first token (vLLM's
    # rule), so all of it is the answer, streamed or not, and none of it counts as reasoning.
    hidden = {"include_reasoning": False}
    reply = client.chat.completions.create(messages=QUESTION, extra_body=hidden, **kwargs, **GREEDY)
    (choice,) = reply.choices
    assert choice.message.reasoning is None
    jsonschema.validate(json.loads(choice.message.content), CITY)
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    chunks = client.chat.completions.create(
        messages=QUESTION, stream=True, extra_body=hidden, **kwargs, **GREEDY
    )
    (streamed,) = accumulate(chunks).values()
    assert streamed["content"] == choice.message.content


def test_past_reasoning_is_taken_back(server):
    """An assistant turn sent back with its reasoning (either name) is accepted."""
    for name in ("reasoning", "reasoning_content"):
        messages = [*QUESTION, {"role": "assistant", name: "Think.", "content": "Paris."}]
        messages.append({"role": "user", "content": "And Italy?"})
        reply = httpx.post(
            f"{server.v1}/chat/completions",
            json={"model": server.model, "messages": messages, "max_tokens": 2},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text


# --- the Responses API --------------------------------------------------------------------


def test_responses_put_the_reasoning_in_an_item_first(server, end_id):
    bias = thinking_bias(server, end_id, QUESTION)
    raw = written(server, QUESTION, max_tokens=12, logit_bias=bias, **GREEDY)
    thought, _, answer = raw["text"].partition("</think>")
    num_reasoning = raw["token_ids"].index(int(end_id))
    client = server.client()
    kwargs = dict(
        model=server.model,
        input=QUESTION[0]["content"],
        max_output_tokens=12,
        temperature=0,
        extra_body={"logit_bias": bias, "reasoning": {"effort": "high"}},
    )
    resp = client.responses.create(**kwargs)
    reasoning, message = resp.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [part.text for part in reasoning.content] == [thought]
    assert message.type == "message" and resp.output_text == answer
    assert resp.usage.output_tokens_details.reasoning_tokens == num_reasoning
    assert resp.reasoning.effort == "high"

    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == thought and final.output_text == answer

    # A continuation takes the reasoning item back, as it would from the client.
    after = client.responses.create(
        model=server.model, input="And Italy?", previous_response_id=resp.id, max_output_tokens=2
    )
    assert after.status in ("completed", "incomplete")


# --- start-up -----------------------------------------------------------------------------


@pytest.fixture
def serve_main():
    """`serve ARGV` in this process, its exit status; main()'s SIGTERM handler put back."""
    handler = signal.getsignal(signal.SIGTERM)

    def run(*argv: str) -> int | str | None:
        try:
            with pytest.raises(SystemExit) as exited:
                main(list(argv))
        finally:
            signal.signal(signal.SIGTERM, handler)
        return exited.value.code

    return run


def test_an_unknown_parser_is_refused_naming_the_parsers(serve_main, capsys):
    assert serve_main("--model", "m", "--reasoning-parser", "r1") == 2  # before anything loads
    err = capsys.readouterr().err
    assert "--reasoning-parser" in err and "'deepseek_r1'" in err and "'qwen3'" in err


def test_deepseek_r1_needs_the_markers_as_tokens(
    serve_main, tiny_llama, tokenizer, monkeypatch, capsys
):
    """vLLM's rule: the parser refuses a tokenizer without <think> and </think> tokens, at
    start-up, once the engine has read the model's tokenizer (which then stops)."""
    stopped = []

    class Engine:  # what serve reads of an engine before it serves
        def __init__(self, config, while_core_loads=None):
            self.tokenizer, self.model_path, self.max_model_len = tokenizer, tiny_llama, 512

        def shutdown(self):
            stopped.append(True)

    monkeypatch.setattr("serve.engine.core_client.EngineCoreClient", Engine)
    argv = ["--model", str(tiny_llama), "--port", str(free_port())]
    assert serve_main(*argv, "--reasoning-parser", "deepseek_r1") == 1
    assert stopped == [True]
    err = capsys.readouterr().err
    assert "--reasoning-parser deepseek_r1 cannot be used" in err
    assert "<think> or </think>" in err
