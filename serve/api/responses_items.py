"""The Responses API's items and the chat conversation they stand for.

Input items become chat messages (instructions a system message first, a function call
joining the assistant message before it as one of its tool calls, a function call's
output a tool message, reasoning the `reasoning` of the assistant turn it starts); the
model's output (its reasoning, with --reasoning-parser, then content text and calls, as
the chat parsers read them) becomes output items, and output items become input items
again for the conversation a continuation starts from.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from serve.api.errors import APIError
from serve.api.protocol_responses import (
    ContentPart,
    FunctionCallItem,
    MessageItem,
    ReasoningItem,
    ReasoningText,
    chat_content,
)
from serve.api.response_store import ConversationItem
from serve.chat.tool_parsers import ToolCall


def new_id(prefix: str) -> str:
    """OpenAI's id shape: `resp_`, `msg_`, `fc_` and hex."""
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_messages(
    instructions: str | None, items: Sequence[ConversationItem]
) -> list[dict[str, Any]]:
    """The chat messages (ChatMessage's fields) of a conversation (a stored chain's items,
    then the request's input). A function_call_output must answer a function_call made
    earlier in it, and every function_call must have its output: a 400 otherwise, as
    OpenAI answers."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    call_names: dict[str, str] = {}
    unanswered: list[str] = []  # call ids, in the order made
    for item in items:
        last = messages[-1] if messages else None
        # An assistant turn opened by reasoning alone, which the answer's text joins.
        thinking = (
            last is not None
            and last["role"] == "assistant"
            and "reasoning" in last
            and last["content"] is None
            and "tool_calls" not in last
        )
        if isinstance(item, ReasoningItem):
            if last is not None and last["role"] == "assistant" and "reasoning" not in last:
                last["reasoning"] = item.text  # vLLM's: the turn's reasoning, if it has none
            else:
                messages.append({"role": "assistant", "content": None, "reasoning": item.text})
        elif isinstance(item, MessageItem):
            if item.role == "assistant" and thinking and last is not None:
                last["content"] = chat_content(item.content)  # the answer after the thinking
            else:
                messages.append({"role": item.role, "content": chat_content(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # content and calls: one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            call_names[item.call_id] = item.name
            unanswered.append(item.call_id)
        else:  # a function_call_output
            if item.call_id not in call_names:
                raise APIError(
                    400,
                    f"No function_call with call_id {item.call_id!r} comes before the "
                    "function_call_output that answers it (in this input or the responses "
                    "it continues).",
                    param="input",
                )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.call_id,
                    "name": call_names[item.call_id],
                    "content": chat_content(item.output),
                }
            )
            unanswered = [call_id for call_id in unanswered if call_id != item.call_id]
    if unanswered:
        raise APIError(
            400, f"No tool output found for function call {unanswered[0]}.", param="input"
        )
    return messages


def message_item(
    text: str, status: str, logprobs: list[dict[str, Any]], item_id: str | None = None
) -> dict[str, Any]:
    return {
        "id": item_id or new_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [output_text_part(text, logprobs)],
    }


def output_text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def reasoning_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    """vLLM's reasoning item: the thinking as its content, no summary."""
    return {
        "id": item_id or new_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [reasoning_text_part(text)],
        "encrypted_content": None,
        "status": status,
    }


def reasoning_text_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def function_call_item(
    call_id: str, name: str, arguments: str, status: str, item_id: str | None = None
) -> dict[str, Any]:
    return {
        "id": item_id or new_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(
    pieces: list[str | ToolCall],
    status: str,
    logprobs: list[dict[str, Any]],
    reasoning: str | None = None,
) -> list[dict[str, Any]]:
    """The reasoning's item, if there is reasoning; then a message per run of text and the
    calls between them, in the order written (as the stream sends them); an empty message
    when there is nothing at all. The tokens' `logprobs` (the content's) go with the
    first message (the stream gives each message its own tokens'; a reply not streamed
    does not know where a call's markup split them)."""
    items = [reasoning_item(reasoning, "completed" if pieces else status)] if reasoning else []
    for piece in pieces:
        if isinstance(piece, str):
            items.append(message_item(piece, status, logprobs))
            logprobs = []
        else:
            items.append(function_call_item(piece.id, piece.name, piece.arguments, status))
    return items or [message_item("", status, logprobs)]


def conversation_items(output: list[dict[str, Any]]) -> list[ConversationItem]:
    """Output items as the input items a continuation sees, as they were sent (a call cut
    short by the token limit is rendered with empty arguments, as vLLM renders it)."""
    items: list[ConversationItem] = []
    for item in output:
        if item["type"] == "message":
            parts = [ContentPart(type="output_text", text=p["text"]) for p in item["content"]]
            items.append(MessageItem(role="assistant", content=parts))
        elif item["type"] == "reasoning":
            texts = [ReasoningText(type="reasoning_text", text=p["text"]) for p in item["content"]]
            items.append(ReasoningItem(type="reasoning", content=texts))
        else:
            fields = {k: item[k] for k in ("type", "call_id", "name", "arguments")}
            items.append(FunctionCallItem.model_construct(**fields))
    return items


def listed_input(item: ConversationItem) -> dict[str, Any]:
    """An input item as GET .../input_items lists it: with its id (the client's, else a new
    one), its text as parts, its status completed."""
    given = (item.model_extra or {}).get("id")

    def item_id(prefix: str) -> str:
        return given if isinstance(given, str) and given else new_id(prefix)

    if isinstance(item, MessageItem):
        parts = item.content
        if isinstance(parts, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            parts = [ContentPart(type=kind, text=parts)]
        content = [p.model_dump(exclude_none=True) for p in parts]
        fields = {"type": "message", "role": item.role, "content": content}
        return {"id": item_id("msg"), **fields, "status": "completed"}
    if isinstance(item, FunctionCallItem):
        fields = {k: getattr(item, k) for k in ("type", "call_id", "name", "arguments")}
        return {"id": item_id("fc"), **fields, "status": "completed"}
    if isinstance(item, ReasoningItem):
        fields = item.model_dump(include={"type", "summary", "content"}, exclude_none=True)
        return {"id": item_id("rs"), **fields}
    output = item.output
    if not isinstance(output, str):
        output = [p.model_dump(exclude_none=True) for p in output]
    fields = {"type": "function_call_output", "call_id": item.call_id, "output": output}
    return {"id": item_id("fco"), **fields, "status": "completed"}


def usage(
    input_tokens: int, output_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0
) -> dict[str, Any]:
    """The Responses API's usage: `cached_tokens` of the input the prefix cache held,
    `reasoning_tokens` of the output that were reasoning (--reasoning-parser)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }
