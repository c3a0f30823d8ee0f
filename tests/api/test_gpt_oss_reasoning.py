"""`--reasoning-parser openai_gptoss` on a server: GPT-OSS's harmony markers, special tokens
that decoded text leaves out, reach the parser (the server decodes these requests' output
with them kept) and never the client: chat's reasoning and content, streamed and not, the
usage's reasoning tokens, the Responses reasoning item, and structured output that holds
the final message alone (its grammar starts after `<|channel|>final<|message|>`).

The tiny llama here has harmony's markers as special tokens of its tokenizer. It cannot
write a harmony header, so its template opens the analysis message itself; logit biases
on `<|end|>` and `<|message|>` make it end its "thinking" and open another message (a
header that names no channel: content). What it writes is read from /v1/completions
with special tokens kept, for the same prompt, greedy, and split by the parser here. To
write the final message's header, the model is steered token by token (`header_controls`).
"""

from __future__ import annotations

import copy
import json
import shutil

import httpx
import jsonschema
import pytest

from serve.chat.reasoning_parsers import get_reasoning_parser
from serve.chat.reasoning_parsers.gpt_oss import MARKERS

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|channel|>analysis"
    "<|message|>{% endif %}"
)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def harmony_model(tiny_model_factory, tmp_path_factory):
    from tiny_models import build_tokenizer

    base = tiny_model_factory("llama", vocab_size=519, max_position_embeddings=2048)
    out = tmp_path_factory.mktemp("tiny-harmony")
    shutil.copytree(base, out, dirs_exist_ok=True)
    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.add_tokens(list(MARKERS), special_tokens=True)
    assert len(tokenizer) == 519
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(server_factory, harmony_model):
    return server_factory("--reasoning-parser", "openai_gptoss", model=harmony_model)


@pytest.fixture(scope="module")
def vocab(harmony_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(harmony_model).get_vocab()


@pytest.fixture(scope="module")
def written(server, vocab):
    """A bias under which the greedy model thinks, then writes another message, and what
    it writes then: its text with the markers, its token ids, and the parser's reading."""
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}, timeout=30)
    prompt_ids = prompt.json()["tokens"]
    reading = get_reasoning_parser("openai_gptoss", vocab).for_request(prompt_ids, {})
    assert reading.opens_in_analysis
    for end_bias, message_bias in [(2, 3), (2, 4), (2.5, 3), (3, 3), (1.5, 3), (2, 5)]:
        bias = {str(vocab["<|end|>"]): end_bias, str(vocab["<|message|>"]): message_bias}
        body = {
            "model": server.model,
            "prompt": prompt_ids,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "logit_bias": bias,
            "skip_special_tokens": False,
            "return_token_ids": True,
        }
        reply = httpx.post(f"{server.v1}/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        raw = reply.json()["choices"][0]
        split = reading.split(raw["text"])
        if split.reasoning and split.content:
            counter = reading.token_counter()
            counter.feed(raw["token_ids"])
            return {"bias": bias, "raw": raw, "split": split, "num_reasoning": counter.num_tokens}
    pytest.fail("no bias makes the tiny model end its thinking and write a message")


def chat_kwargs(server, written) -> dict:
    return dict(
        model=server.model,
        messages=QUESTION,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logit_bias=written["bias"],
    )


def test_chat_reads_the_analysis_apart_from_the_answer(server, written):
    assert "<|end|>" in written["raw"]["text"]  # the markers are in the output
    reply = server.client().chat.completions.create(**chat_kwargs(server, written))
    message = reply.choices[0].message
    split = written["split"]
    assert (message.reasoning, message.content) == (split.reasoning, split.content)
    for part in (message.reasoning, message.content):
        assert not any(marker in part for marker in MARKERS)
    details = reply.usage.completion_tokens_details
    assert details.reasoning_tokens == written["num_reasoning"] > 0
    assert reply.usage.completion_tokens == len(written["raw"]["token_ids"])


def test_streamed_chat_gives_the_same_split(server, written):
    stream = server.client().chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **chat_kwargs(server, written)
    )
    reasoning, content, usage = "", "", None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
    assert (reasoning, content) == (written["split"].reasoning, written["split"].content)
    assert usage.completion_tokens_details.reasoning_tokens == written["num_reasoning"]


def test_responses_put_the_analysis_in_a_reasoning_item(server, written):
    resp = server.client().responses.create(
        model=server.model,
        input=QUESTION[0]["content"],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"logit_bias": written["bias"]},
    )
    reasoning, message = resp.output
    assert [part.text for part in reasoning.content] == [written["split"].reasoning]
    assert message.type == "message" and resp.output_text == written["split"].content


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
}
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
THOUGHT, HEADER = "Hmm", "<|channel|>final<|message|>"


@pytest.fixture(scope="module")
def header_controls(harmony_model) -> dict:
    """Controls under which the greedy model thinks "Hmm", then writes the final message's
    header: each token of `Hmm<|channel|>final<|message|>` (`final` is three tokens here)
    biased above the next and far above the model's own logits, and banned after itself
    and each token after it (bad words of two tokens), so that they come in turn; after
    `<|message|>` nothing is banned, and the model starts over."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(harmony_model)
    chain = tokenizer.encode(THOUGHT + HEADER, add_special_tokens=False)
    assert len(chain) == 7
    bad_words = []
    for i, token in enumerate(chain[:-1]):
        for earlier in chain[: i + 1]:
            word = tokenizer.decode([token, earlier])
            assert tokenizer.encode(word, add_special_tokens=False) == [token, earlier]
            bad_words.append(word)
    bias = {str(token): 100 - 10 * i for i, token in enumerate(chain)}
    return {"logit_bias": bias, "bad_words": bad_words, "temperature": 0}


def complete(server, prompt_ids: list[int], controls: dict, **fields) -> dict:
    """/v1/completions' choice for the prompt, its special tokens kept in the text."""
    body = {"model": server.model, "prompt": prompt_ids, "max_tokens": 30, **controls}
    body |= {"skip_special_tokens": False, **fields}
    reply = httpx.post(f"{server.v1}/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_a_grammar_holds_the_final_message_alone(server, header_controls):
    """Structured output waits for `<|channel|>final<|message|>`, five tokens here: the
    analysis before it is what the model writes without a format, the final message's
    text follows the schema; chat reads them apart, streamed alike; completions (whose
    grammar waits alike) show the header where the grammar started."""
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}, timeout=30)
    prompt_ids = prompt.json()["tokens"]
    free = complete(server, prompt_ids, header_controls)["text"]
    assert free.startswith(THOUGHT + HEADER + "H")  # unconstrained, it thinks again
    held = complete(server, prompt_ids, header_controls, response_format=CITY_FORMAT)
    thought, header, answer = held["text"].partition(HEADER)
    assert (thought, header) == (THOUGHT, HEADER)
    jsonschema.validate(json.loads(answer), CITY)
    assert held["finish_reason"] == "stop"

    client = server.client()
    kwargs = dict(
        model=server.model,
        messages=QUESTION,
        max_tokens=30,
        temperature=0,
        logit_bias=header_controls["logit_bias"],
        response_format=CITY_FORMAT,
        extra_body={"bad_words": header_controls["bad_words"]},
    )
    reply = client.chat.completions.create(**kwargs)
    (choice,) = reply.choices
    assert (choice.message.reasoning, choice.message.content) == (THOUGHT, answer)
    assert choice.finish_reason == "stop"
    assert reply.usage.completion_tokens_details.reasoning_tokens == 2  # H, mm
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for part in chunk.choices:
            reasoning += part.delta.model_dump().get("reasoning") or ""
            content += part.delta.content or ""
    assert (reasoning, content) == (THOUGHT, answer)


def test_a_grammar_holds_an_opened_final_message_from_its_first_token(
    server, harmony_model, header_controls
):
    """A prompt that opened the final message: the output is all answer, held from its
    first token (the controls would have it write "Hmm" first)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(harmony_model)
    opened = tokenizer.encode(
        "<|start|>user<|message|>What is the capital of France?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>",
        add_special_tokens=False,
    )
    assert complete(server, opened, header_controls)["text"].startswith(THOUGHT)
    held = complete(server, opened, header_controls, response_format=CITY_FORMAT)
    jsonschema.validate(json.loads(held["text"]), CITY)
    assert held["finish_reason"] == "stop"


def test_without_its_reasoning_a_grammar_holds_the_whole_output(server, header_controls):
    """include_reasoning false: the grammar holds the output from its first token (vLLM's
    rule); none of it is reasoning."""
    body = {
        "model": server.model,
        "messages": QUESTION,
        "max_tokens": 30,
        "response_format": CITY_FORMAT,
        "include_reasoning": False,
        **header_controls,
    }
    reply = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message["reasoning"] is None
    jsonschema.validate(json.loads(message["content"]), CITY)
