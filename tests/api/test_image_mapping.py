"""Images sent through the Anthropic Messages and Responses APIs reach the chat path as
OpenAI's `image_url` parts, in their place among the text (the chat path then reads them
as it reads chat's own)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serve.api.protocol_anthropic import MessagesRequest
from serve.api.protocol_responses import MessageItem, chat_content

PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}


def _chat(messages: list[dict]) -> list[dict]:
    request = MessagesRequest(model="m", max_tokens=4, messages=messages)
    return request.chat_fields()["messages"]


def test_anthropic_image_blocks_become_image_url_parts():
    chat = _chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    {"type": "image", "source": PNG},
                    {"type": "image", "source": {"type": "url", "url": "https://x.test/a.jpg"}},
                ],
            }
        ]
    )
    assert chat == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "image_url", "image_url": {"url": "https://x.test/a.jpg"}},
            ],
        }
    ]


def test_anthropic_turns_merge_with_their_images_in_order():
    """Consecutive user turns are one turn, as Anthropic's API reads them: text alone
    stays one string; with an image, the parts of both in order."""
    text_only = _chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert text_only == [{"role": "user", "content": "a\nb"}]
    merged = _chat(
        [
            {"role": "user", "content": "first"},
            {"role": "user", "content": [{"type": "image", "source": PNG}]},
        ]
    )
    assert merged[0]["content"] == [
        {"type": "text", "text": "first"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]


def test_anthropic_refuses_images_outside_a_user_turn_and_odd_sources():
    image = {"type": "image", "source": PNG}
    with pytest.raises(ValidationError, match="type 'image'"):
        _chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [image]}])
    with pytest.raises(ValidationError, match="media_type"):
        bad = {"type": "image", "source": {**PNG, "media_type": "image/tiff"}}
        _chat([{"role": "user", "content": [bad]}])


def test_responses_input_image_becomes_an_image_url_part():
    item = MessageItem(
        role="user",
        content=[
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": "https://x.test/b.png", "detail": "low"},
        ],
    )
    assert chat_content(item.content) == [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://x.test/b.png", "detail": "low"}},
    ]
    with pytest.raises(ValidationError, match="Files API"):
        MessageItem(role="user", content=[{"type": "input_image", "file_id": "file-1"}])
