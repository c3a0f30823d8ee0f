"""ResponseStore on a fake clock: the size bound drops the least recently used response,
the TTL drops a response that age whatever its use, and a deleted one is gone."""

from __future__ import annotations

import pytest

from serve.api.protocol_responses import MessageItem
from serve.api.response_store import ResponseStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def put(store: ResponseStore, response_id: str) -> None:
    conversation = [MessageItem(role="user", content=f"question of {response_id}")]
    store.put(response_id, {"id": response_id}, conversation)


def test_a_stored_response_comes_back_with_its_conversation():
    store = ResponseStore(4, 60.0)
    put(store, "resp_a")
    entry = store.get("resp_a")
    assert entry.body == {"id": "resp_a"}
    assert [item.content for item in entry.conversation] == ["question of resp_a"]
    assert store.get("resp_b") is None


def test_the_size_bound_drops_the_oldest():
    store = ResponseStore(2, 60.0)
    for name in ("resp_a", "resp_b", "resp_c"):
        put(store, name)
    assert store.get("resp_a") is None
    assert store.get("resp_b") is not None and store.get("resp_c") is not None
    assert len(store) == 2


def test_the_size_bound_drops_the_least_recently_used():
    store = ResponseStore(2, 60.0)
    put(store, "resp_a")
    put(store, "resp_b")
    assert store.get("resp_a") is not None  # a is now used more recently than b
    put(store, "resp_c")
    assert store.get("resp_b") is None
    assert store.get("resp_a") is not None and store.get("resp_c") is not None


def test_responses_expire_after_the_ttl_however_recently_used():
    clock = FakeClock()
    store = ResponseStore(8, 10.0, clock)
    put(store, "resp_a")
    clock.now = 5.0
    put(store, "resp_b")
    clock.now = 9.9
    assert store.get("resp_a") is not None  # a use does not extend its life
    clock.now = 10.0
    assert store.get("resp_a") is None
    assert not store.delete("resp_a")
    assert store.get("resp_b") is not None
    clock.now = 15.0
    assert store.get("resp_b") is None and len(store) == 0


def test_delete_removes_once():
    store = ResponseStore(8, 60.0)
    put(store, "resp_a")
    assert store.delete("resp_a")
    assert store.get("resp_a") is None
    assert not store.delete("resp_a")
    put(store, "resp_b")  # the store still takes new ones
    assert len(store) == 1


@pytest.mark.parametrize(("max_entries", "ttl_s"), [(0, 1.0), (1, 0.0)])
def test_an_empty_or_instant_store_is_refused(max_entries, ttl_s):
    with pytest.raises(ValueError):
        ResponseStore(max_entries, ttl_s)
