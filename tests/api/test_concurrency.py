"""Many clients at once, and clients that go away mid-stream."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import httpx
import openai
import pytest
from api.conftest import wait_until_idle

NUM_CLIENTS = 64
MAX_TOKENS = 8


def request_for(i: int) -> tuple[str, dict]:
    """Half chat, half completions, all different prompts, all greedy."""
    common = {"temperature": 0, "max_tokens": MAX_TOKENS}
    if i % 2:
        return "completions", {"prompt": f"Numbers: {i} {i + 1} {2 * i}", **common}
    messages = [{"role": "user", "content": f"What is {i} + {i}? Be brief, number {i}."}]
    return "chat", {"messages": messages, **common}


def test_concurrent_streaming_clients_match_solo_answers(server, client):
    solo = []
    for i in range(NUM_CLIENTS):
        kind, kwargs = request_for(i)
        if kind == "chat":
            choice = client.chat.completions.create(model=server.model, **kwargs).choices[0]
            solo.append((choice.message.content, choice.finish_reason))
        else:
            choice = client.completions.create(model=server.model, **kwargs).choices[0]
            solo.append((choice.text, choice.finish_reason))

    async def one(aclient, i: int) -> tuple[str, str | None]:
        kind, kwargs = request_for(i)
        if kind == "chat":
            stream = await aclient.chat.completions.create(
                model=server.model, stream=True, **kwargs
            )
            chunks = [c.choices[0] async for c in stream]
            return "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
        stream = await aclient.completions.create(model=server.model, stream=True, **kwargs)
        chunks = [c.choices[0] async for c in stream]
        return "".join(c.text for c in chunks), chunks[-1].finish_reason

    async def all_at_once() -> list[tuple[str, str | None]]:
        async with server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(NUM_CLIENTS)))

    together = asyncio.run(all_at_once())
    mismatches = [i for i in range(NUM_CLIENTS) if together[i] != solo[i]]
    assert not mismatches, [(i, solo[i], together[i]) for i in mismatches[:5]]


NUM_BLOCKS = 24  # block size 16: a 384-token KV cache, so max_model_len is 384 too
LEAK_TIMEOUT_S = 30  # the requests below take a second or two; a leak makes them hang


def count_disconnects(server) -> int:
    return len(re.findall(r'"POST /v1/\S*completions" 499 ', server.log()))


def test_disconnected_streams_release_their_blocks(server_factory):
    """Clients hang up mid-stream; then requests that need the whole KV cache still run.
    A block leaked by an aborted request would leave a full-cache request unschedulable
    (the client would time out)."""
    server = server_factory("--num-gpu-blocks-override", str(NUM_BLOCKS))
    max_model_len = httpx.get(f"{server.v1}/models").json()["data"][0]["max_model_len"]
    assert max_model_len == NUM_BLOCKS * 16

    long = {"temperature": 1.0, "max_tokens": 300, "ignore_eos": True, "stream": True}
    hang_ups = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2}),
        ("/v1/completions", {"prompt": "The sea is wide"}),
        ("/v1/completions", {"prompt": ["Once upon a time", "Hello"]}),
    ]
    before = count_disconnects(server)
    for path, body in hang_ups:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", path, json={**body, **long}) as resp:
                assert resp.status_code == 200
                events = 0
                for line in resp.iter_lines():
                    events += line.startswith("data: ")
                    if events == 3:
                        break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 15
    while count_disconnects(server) < before + len(hang_ups) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert count_disconnects(server) == before + len(hang_ups), server.log()[-3000:]

    client = server.client().with_options(timeout=LEAK_TIMEOUT_S)
    prompt_ids = list(range(10, 20))

    async def burst() -> list[int]:
        """Four requests of 6 blocks each: the whole cache between them."""
        async with server.async_client().with_options(timeout=LEAK_TIMEOUT_S) as aclient:
            outs = await asyncio.gather(
                *(
                    aclient.completions.create(
                        model=server.model,
                        prompt=[t + i for t in prompt_ids],
                        max_tokens=6 * 16 - len(prompt_ids),
                        extra_body={"ignore_eos": True},
                    )
                    for i in range(4)
                )
            )
            return [o.usage.completion_tokens for o in outs]

    try:
        assert asyncio.run(burst()) == [6 * 16 - len(prompt_ids)] * 4
        # One request as long as the context window needs every block in the cache.
        full = client.completions.create(
            model=server.model,
            prompt=prompt_ids,
            max_tokens=max_model_len - len(prompt_ids),
            extra_body={"ignore_eos": True},
        )
    except openai.APITimeoutError:
        pytest.fail("requests needing the whole KV cache never finished: blocks leaked?")
    assert full.choices[0].finish_reason == "length"
    assert full.usage.total_tokens == max_model_len
    assert server.process.poll() is None


def test_non_streaming_client_that_leaves_aborts_its_request(server_factory):
    """A client that times out on a non-streamed request: the server notices the hang-up
    as it happens and aborts the request (logged 499, not a 200 after generating everything)."""
    server = server_factory("--num-gpu-blocks-override", str(NUM_BLOCKS))
    before = count_disconnects(server)
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 370}
    # The tiny model writes the 370 tokens in ~0.25 s on a quick machine; the client leaves
    # after 0.1 s and the server hears the connection close at once.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.v1}/completions", json={**body, "ignore_eos": True}, timeout=0.1)
    deadline = time.monotonic() + 10
    while count_disconnects(server) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count_disconnects(server) == before + 1, server.log()[-2000:]
    assert not re.search(
        r'"POST /v1/completions" 200 prompt_tokens=\d+ completion_tokens=370 ', server.log()
    )


STORM_STREAMS = 100
STORM_CUT = 50
STORM_MAX_TOKENS = 64
NEW_REQUEST_S = 5.0


def test_disconnect_storm_frees_every_block(long_context_model, server_factory):
    """100 streams at once, 50 cut off at random points: the other 50 finish whole, a new
    request completes within 5 s of the storm, and afterwards no KV block is held."""
    server = server_factory("--max-model-len", "4096", model=long_context_model)
    rng = random.Random(7)
    cut_after = {i: rng.randint(1, STORM_MAX_TOKENS // 2) for i in rng.sample(range(100), 50)}
    body = {
        "model": server.model,
        "max_tokens": STORM_MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def stream(client: httpx.AsyncClient, i: int) -> int | None:
        """The completion tokens of a whole stream; None for one cut off after
        `cut_after[i]` content events."""
        request = {**body, "prompt": f"Story {i}: once upon a time"}
        events, completion_tokens = 0, None
        async with client.stream("POST", f"{server.v1}/completions", json=request) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                events += 1
                if events == cut_after.get(i):
                    return None  # leaving the block closes the connection
                usage = json.loads(line.removeprefix("data: ")).get("usage")
                if usage:
                    completion_tokens = usage["completion_tokens"]
        return completion_tokens

    async def storm() -> tuple[list[int], float]:
        limits = httpx.Limits(max_connections=STORM_STREAMS + 1)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            streams = [asyncio.create_task(stream(client, i)) for i in range(STORM_STREAMS)]
            cuts = [streams[i] for i in cut_after]
            await asyncio.gather(*cuts)
            start = time.monotonic()
            new = await client.post(
                f"{server.v1}/completions",
                json={"model": server.model, "prompt": "After the storm", "max_tokens": 8},
            )
            new_s = time.monotonic() - start
            assert new.status_code == 200 and new.json()["usage"]["completion_tokens"] == 8
            return await asyncio.gather(*streams), new_s

    completion_tokens, new_request_s = asyncio.run(storm())
    assert completion_tokens == [
        None if i in cut_after else STORM_MAX_TOKENS for i in range(STORM_STREAMS)
    ]
    assert new_request_s < NEW_REQUEST_S
    metrics = wait_until_idle(server)
    assert metrics["serve_num_requests_running"] == 0
    assert metrics["serve_kv_cache_blocks_used"] == 0
    assert server.process.poll() is None
