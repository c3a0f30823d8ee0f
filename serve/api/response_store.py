"""ResponseStore: the responses POST /v1/responses keeps (`store`, the default), bounded in
number (`--response-store-max-entries`, least recently used dropped first) and in age
(`--response-store-ttl-s`, counted from when it was stored). In memory: a restart forgets
them, and replicas behind a load balancer do not share them.

Each entry holds the response as GET returns it, the conversation a continuation
(`previous_response_id`) starts from (every input item of the chain so far and this
response's output, as input items), and the items GET .../input_items lists (the chain's
inputs and earlier outputs, as OpenAI lists them, each with its id). It is used from the
event loop's thread only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serve.api.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
)

ConversationItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object
    conversation: tuple[ConversationItem, ...]  # instructions left out, as OpenAI does
    expires_at: float  # on the store's clock
    listed_inputs: tuple[dict[str, Any], ...] = ()  # GET input_items's, oldest first


class ResponseStore:
    def __init__(
        self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_entries < 1 or not ttl_s > 0:
            raise ValueError("a response store holds at least one entry, for a positive time")
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest use first
        # The same ids in the order they were stored, which is the order they expire in
        # (the TTL is the same for all): expiry looks only at the front.
        self._by_age: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        self._drop_expired()
        return len(self._entries)

    def put(
        self,
        response_id: str,
        body: dict[str, Any],
        conversation: list[ConversationItem],
        listed_inputs: list[dict[str, Any]] | None = None,
    ) -> None:
        self._drop_expired()
        self._remove(response_id)
        expires_at = self.clock() + self.ttl_s
        entry = StoredResponse(body, tuple(conversation), expires_at, tuple(listed_inputs or ()))
        self._entries[response_id] = entry
        self._by_age[response_id] = entry.expires_at
        while len(self._entries) > self.max_entries:
            self._remove(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        """The response, now the most recently used; None if unknown, deleted or expired."""
        self._drop_expired()
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Whether there was such a response (expired ones are gone already)."""
        self._drop_expired()
        return self._remove(response_id)

    def _remove(self, response_id: str) -> bool:
        self._by_age.pop(response_id, None)
        return self._entries.pop(response_id, None) is not None

    def _drop_expired(self) -> None:
        now = self.clock()
        while self._by_age:
            response_id, expires_at = next(iter(self._by_age.items()))
            if expires_at > now:
                return
            self._remove(response_id)
