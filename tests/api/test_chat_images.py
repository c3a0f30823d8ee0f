"""Images in chat completions, as vLLM serves them: `image_url` parts (data URLs, http
URLs fetched from a local server, file URLs under --allowed-local-media-path) reach a
tiny LLaVA, whose greedy output equals HF transformers' on the same widened prompt and
image, token for token; `usage.prompt_tokens` and the context check count the widened
prompt. What cannot be served is a 400 that says why: an image for a text-only model,
too many images, one that cannot be read or fetched (quickly), placeholders and images
that do not pair up. The Responses and Messages APIs reach the same path."""

from __future__ import annotations

import time

import httpx
import pytest
from api.openai_errors import assert_openai_error
from image_fixtures import closed_port, data_url, hf_chat_prompt, image_server, png_bytes
from tiny_models import LLAVA_TOKENS_PER_IMAGE, build_llava_tokenizer, hf_vl_greedy, random_image

MAX_TOKENS = 8
QUESTION = "What is this?"
IMAGES = [random_image(seed) for seed in (21, 22)]
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
CHAT = "/v1/chat/completions"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(server, content, **fields) -> dict:
    messages = [{"role": "user", "content": content}]
    return {"model": server.model, "messages": messages, "return_token_ids": True} | GREEDY | fields


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{CHAT}", json=body, timeout=60)


@pytest.fixture(scope="module")
def tokenizer():
    return build_llava_tokenizer()


@pytest.fixture(scope="module")
def web():
    """Serves IMAGES[i] at /i.png."""
    with image_server(slow_s=10.0) as served:
        for i, image in enumerate(IMAGES):
            served.files[f"/{i}.png"] = png_bytes(image)
        yield served


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "0.png").write_bytes(png_bytes(IMAGES[0]))
    return folder


@pytest.fixture(scope="module")
def llava(server_factory, tiny_llava):
    return server_factory(model=tiny_llava)


@pytest.fixture(scope="module")
def one_image_llava(server_factory, tiny_llava, media_dir):
    return server_factory(
        "--limit-mm-per-prompt",
        '{"image": 1}',
        "--allowed-local-media-path",
        str(media_dir),
        model=tiny_llava,
    )


def expected(tokenizer, model_dir, content, images) -> tuple[list[int], list[int]]:
    """HF's widened prompt for one user turn of `content` (HF's parts), and its greedy
    continuation."""
    prompt = hf_chat_prompt(tokenizer, content)
    return prompt, hf_vl_greedy(model_dir, prompt, images, MAX_TOKENS)


HF_ONE_IMAGE = [{"type": "image"}, {"type": "text", "text": QUESTION}]


@pytest.mark.parametrize("source", ["data", "http"])
def test_greedy_chat_with_an_image_matches_hf(llava, web, tokenizer, tiny_llava, source):
    url = data_url(IMAGES[0]) if source == "data" else f"{web.url}/0.png"
    reply = post(llava, chat(llava, [image_part(url), {"type": "text", "text": QUESTION}]))
    assert reply.status_code == 200, reply.text
    body = reply.json()
    prompt, tokens = expected(tokenizer, tiny_llava, HF_ONE_IMAGE, IMAGES[:1])
    assert body["prompt_token_ids"] == prompt
    assert body["choices"][0]["token_ids"] == tokens
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(tokens)
    # The usage counts the image's run of tokens, not its one placeholder.
    assert body["usage"]["prompt_tokens"] == len(prompt)
    text_only = hf_chat_prompt(tokenizer, QUESTION)
    assert len(prompt) == len(text_only) + 16


def test_the_image_decides_the_answer(llava, tokenizer, tiny_llava):
    """Another image, another answer; the same image again, the same; two in one turn."""

    def tokens(content) -> list[int]:
        reply = post(llava, chat(llava, content))
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["token_ids"]

    first = tokens([image_part(data_url(IMAGES[0])), {"type": "text", "text": QUESTION}])
    other = tokens([image_part(data_url(IMAGES[1])), {"type": "text", "text": QUESTION}])
    again = tokens([image_part(data_url(IMAGES[0])), {"type": "text", "text": QUESTION}])
    assert first != other and first == again
    both = [
        image_part(data_url(IMAGES[0])),
        {"image_url": data_url(IMAGES[1])},
    ]  # vLLM's short form
    hf_both = [{"type": "image"}, {"type": "image"}]
    assert tokens(both) == expected(tokenizer, tiny_llava, hf_both, IMAGES)[1]


def test_a_streamed_reply_is_the_same(llava, tokenizer):
    content = [image_part(data_url(IMAGES[1])), {"type": "text", "text": QUESTION}]
    whole = post(llava, chat(llava, content)).json()
    body = chat(llava, content, stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    with httpx.stream("POST", f"{llava.url}{CHAT}", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
            usage = chunk.get("usage") or usage
    assert text == whole["choices"][0]["message"]["content"]
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_the_openai_client_sends_images(llava, tokenizer, tiny_llava):
    client = llava.client()
    reply = client.chat.completions.create(
        model=llava.model,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": data_url(IMAGES[0]), "detail": "low"},
                    },
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    prompt, tokens = expected(tokenizer, tiny_llava, HF_ONE_IMAGE, IMAGES[:1])
    assert reply.choices[0].model_extra["token_ids"] == tokens
    assert reply.usage.prompt_tokens == len(prompt)


def test_responses_and_messages_take_images_too(llava):
    """Responses' input_image and Anthropic's image blocks reach the same prompt."""
    url = data_url(IMAGES[0])
    no_eos = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
    want = post(llava, chat(llava, [image_part(url), {"type": "text", "text": QUESTION}], **no_eos))
    want_text = want.json()["choices"][0]["message"]["content"]
    response = httpx.post(
        f"{llava.url}/v1/responses",
        json={
            "model": llava.model,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": url},
                        {"type": "input_text", "text": QUESTION},
                    ],
                }
            ],
            "temperature": 0.0,
            "max_output_tokens": MAX_TOKENS,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.json()["output"][-1]["content"][0]["text"] == want_text
    png = url.split(",", 1)[1]
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    message = httpx.post(
        f"{llava.url}/v1/messages",
        json={
            "model": llava.model,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "messages": [{"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}],
        },
        timeout=60,
    )
    assert message.status_code == 200, message.text
    assert message.json()["content"][0]["text"] == want_text


# -- refusals -------------------------------------------------------------------------------


def test_a_text_only_model_refuses_images(server):
    reply = post(server, chat(server, [image_part(data_url(IMAGES[0]))]))
    error = assert_openai_error(reply, 400, "messages")
    assert server.model in error["message"] and "images" in error["message"]


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ([image_part("data:image/png;base64,!!!")], "not valid base64"),
        ([image_part("data:image/png;base64,aGVsbG8=")], "not an image"),
        ([image_part("file:///etc/hostname")], "--allowed-local-media-path"),
        ([image_part("ftp://example.com/a.png")], "must be a data:"),
        (
            [{"type": "text", "text": "<image> and"}, image_part(data_url(IMAGES[0]))],
            "2 image placeholders",
        ),
    ],
    ids=["bad-base64", "not-an-image", "file-without-flag", "ftp", "placeholder-in-text"],
)
def test_bad_images_are_400s(llava, content, said):
    error = assert_openai_error(post(llava, chat(llava, content)), 400, "messages")
    assert said in error["message"]


def test_fetch_failures_are_quick_400s(llava, web):
    for url, said in [
        (f"http://127.0.0.1:{closed_port()}/0.png", "failed"),
        (f"{web.url}/missing.png", "HTTP 404"),
    ]:
        start = time.monotonic()
        error = assert_openai_error(post(llava, chat(llava, [image_part(url)])), 400, "messages")
        assert said in error["message"] and time.monotonic() - start < 4.0
    ok = post(llava, chat(llava, [image_part(f"{web.url}/1.png")]))
    assert ok.status_code == 200, ok.text  # the server serves on


def test_truncation_and_the_context_count_the_widened_prompt(llava, tokenizer):
    url = data_url(IMAGES[0])
    cut = chat(llava, [image_part(url)], truncate_prompt_tokens=10)
    assert_openai_error(post(llava, cut), 400, "truncate_prompt_tokens")
    # 33 images' runs (16 tokens each) overflow the tiny model's 512-token context.
    many = [image_part(url)] * 33
    error = assert_openai_error(post(llava, chat(llava, many)), 400, "messages")
    num_tokens = len(hf_chat_prompt(tokenizer, [{"type": "image"}] * 33))
    assert error["code"] == "context_length_exceeded"
    assert f"resulted in {num_tokens} tokens" in error["message"]


def test_the_limit_and_local_files(one_image_llava, media_dir, tokenizer, tiny_llava):
    """--limit-mm-per-prompt 1 refuses a second image; --allowed-local-media-path serves
    its files, and nothing outside it."""
    server = one_image_llava
    two = [image_part(data_url(IMAGES[0])), image_part(data_url(IMAGES[1]))]
    error = assert_openai_error(post(server, chat(server, two)), 400, "messages")
    assert "at most 1 image(s)" in error["message"] and "--limit-mm-per-prompt" in error["message"]
    local = post(server, chat(server, [image_part(f"file://{media_dir}/0.png")]))
    assert local.status_code == 200, local.text
    hf_image = [{"type": "image"}]
    assert (
        local.json()["choices"][0]["token_ids"]
        == expected(tokenizer, tiny_llava, hf_image, IMAGES[:1])[1]
    )
    outside = image_part(f"file://{media_dir}/../0.png")
    error = assert_openai_error(post(server, chat(server, [outside])), 400, "messages")
    assert "must be under" in error["message"]


def test_a_requests_mm_processor_kwargs_reach_the_image_processor(llava, tokenizer, tiny_llava):
    """vLLM's per-request mm_processor_kwargs: CLIP's processor without normalization gives
    other pixels, so another answer (HF's under the same arguments); an argument the
    processor does not take is a 400 that names it."""
    content = [image_part(data_url(IMAGES[0])), {"type": "text", "text": QUESTION}]
    plain = post(llava, chat(llava, content)).json()
    raw = post(llava, chat(llava, content, mm_processor_kwargs={"do_normalize": False})).json()
    prompt = hf_chat_prompt(tokenizer, HF_ONE_IMAGE)
    expected = hf_vl_greedy(tiny_llava, prompt, IMAGES[:1], MAX_TOKENS, {"do_normalize": False})
    assert raw["choices"][0]["token_ids"] == expected
    assert raw["choices"][0]["token_ids"] != plain["choices"][0]["token_ids"]
    bad = chat(llava, content, mm_processor_kwargs={"no_such_argument": 1})
    error = assert_openai_error(post(llava, bad), 400, "messages")
    assert "no_such_argument" in error["message"]


def test_token_counts_hold_each_images_run(llava, tokenizer):
    """/tokenize's messages form and Anthropic's count_tokens read the images and count
    their runs, as the engine runs the prompt (vLLM's /tokenize does too)."""
    content = [image_part(data_url(IMAGES[0])), {"type": "text", "text": QUESTION}]
    reply = httpx.post(
        f"{llava.url}/tokenize",
        json={"model": llava.model, "messages": [{"role": "user", "content": content}]},
    ).json()
    assert reply["tokens"] == hf_chat_prompt(tokenizer, HF_ONE_IMAGE)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png"}}
    image["source"]["data"] = data_url(IMAGES[0]).split(",", 1)[1]
    counted = httpx.post(
        f"{llava.url}/v1/messages/count_tokens",
        json={"model": llava.model, "messages": [{"role": "user", "content": [image]}]},
    ).json()
    text_only = httpx.post(
        f"{llava.url}/v1/messages/count_tokens",
        json={"model": llava.model, "messages": [{"role": "user", "content": ""}]},
    ).json()
    assert counted["input_tokens"] == text_only["input_tokens"] + LLAVA_TOKENS_PER_IMAGE
    bad = [image_part("data:image/png;base64,!!!")]
    error = httpx.post(
        f"{llava.url}/tokenize",
        json={"model": llava.model, "messages": [{"role": "user", "content": bad}]},
    )
    assert error.status_code == 400 and "base64" in error.json()["error"]["message"]
