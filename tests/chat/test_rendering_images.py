"""Images in a conversation, rendered as vLLM renders them: `{"type": "image"}` in place
for a template that loops over the parts, placeholders before the text for one that takes
text, in any role; `chat_images` lists them in the placeholders' order. No model."""

from __future__ import annotations

import pytest

from serve.chat.rendering import ChatRenderError, chat_images, render_chat, template_messages

IMAGE = "<image>"
URL_A, URL_B = "data:image/png;base64,AAAA", "https://example.com/b.png"
PARTS = [
    {"type": "text", "text": "Compare"},
    {"type": "image_url", "image_url": {"url": URL_A, "detail": "low"}},
    {"image_url": URL_B},  # vLLM's short form
]


def test_openai_format_puts_image_parts_in_place():
    (message,) = template_messages([{"role": "user", "content": PARTS}], "openai", IMAGE)
    assert message["content"] == [
        {"type": "text", "text": "Compare"},
        {"type": "image"},
        {"type": "image"},
    ]


def test_string_format_puts_placeholders_before_the_text():
    (message,) = template_messages([{"role": "user", "content": PARTS}], "string", IMAGE)
    assert message["content"] == "<image>\n<image>\nCompare"
    image_only = [{"role": "user", "content": [{"image_url": URL_A}]}]
    assert template_messages(image_only, "string", IMAGE)[0]["content"] == "<image>"


def test_string_format_counts_the_placeholders_the_text_places():
    placed = [{"type": "text", "text": "Left <image> right"}, {"image_url": URL_A}, PARTS[1]]
    (message,) = template_messages([{"role": "user", "content": placed}], "string", IMAGE)
    assert message["content"] == "<image>\nLeft <image> right"  # one placed, one added
    with pytest.raises(ChatRenderError, match="holds 2 image placeholders"):
        text = [{"type": "text", "text": "<image><image>"}, {"image_url": URL_A}]
        template_messages([{"role": "user", "content": text}], "string", IMAGE)


def test_images_in_any_role_and_a_tool_result_keeps_its_parts():
    messages = [
        {"role": "assistant", "content": [{"image_url": URL_A}, {"type": "text", "text": "Mine"}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"image_url": URL_B}]},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "42"}]},
    ]
    assistant, tool, text_tool = template_messages(messages, "openai", IMAGE)
    assert assistant["content"] == [{"type": "image"}, {"type": "text", "text": "Mine"}]
    assert tool["content"] == [{"type": "image"}]
    assert text_tool["content"] == "42"  # a text result stays one string, as before
    assert chat_images(messages) == [URL_A, URL_B]


def test_chat_images_in_prompt_order_and_image_pil_offline():
    pil = object()  # any object stands for a PIL image here
    messages = [
        {"role": "user", "content": [{"type": "image_pil", "image_pil": pil}]},
        {"role": "user", "content": "text"},
        {"role": "user", "content": PARTS},
    ]
    assert chat_images(messages) == [pil, URL_A, URL_B]


def test_a_model_without_images_refuses_them():
    with pytest.raises(ChatRenderError, match="takes no images"):
        template_messages([{"role": "user", "content": PARTS}], "openai", None)
    with pytest.raises(ChatRenderError, match="needs its image or URL"):
        template_messages([{"role": "user", "content": [{"image_url": {}}]}], "openai", IMAGE)
    with pytest.raises(ChatRenderError, match="got 'video_url'"):
        template_messages([{"role": "user", "content": [{"type": "video_url"}]}], "openai", IMAGE)


def test_render_chat_writes_the_placeholder_token():
    from tiny_models import LLAVA_CHAT_TEMPLATE, build_llava_tokenizer

    tokenizer = build_llava_tokenizer()
    image_id = tokenizer.convert_tokens_to_ids(IMAGE)
    messages = [{"role": "user", "content": PARTS}]
    for content_format in ("openai", "string"):
        text, ids = render_chat(
            tokenizer,
            messages,
            True,
            LLAVA_CHAT_TEMPLATE,
            content_format=content_format,
            image_placeholder=IMAGE,
        )
        assert text.count(IMAGE) == 2 and ids.count(image_id) == 2, content_format
