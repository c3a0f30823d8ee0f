"""sjf through the server: once it has learned the lengths, a short request sent behind
two long ones on one seat runs before the second, and /metrics shows what that cost the
passed-over ones against the bound, and the predictor's error."""

from __future__ import annotations

import asyncio

import httpx
from api.conftest import wait_until_idle

SHORT, LONG = 2, 60  # output tokens
NUM_WARMUP = 40  # sjf predicts after 32 finished requests


def test_sjf_metrics_show_the_predictor_error_and_the_longest_passed_over(server_factory):
    server = server_factory("--scheduling-policy", "sjf", "--max-num-seqs", "1")

    def body(max_tokens: int, **extra) -> dict:
        ask = "Answer in one word." if max_tokens == SHORT else "Write a long essay."
        return {
            "model": server.model,
            "prompt": ask,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            **extra,
        }

    for i in range(NUM_WARMUP):  # one at a time: no one waits
        resp = httpx.post(f"{server.v1}/completions", json=body((SHORT, LONG)[i % 2]), timeout=30)
        assert resp.status_code == 200, resp.text
    warm = wait_until_idle(server)
    assert warm["serve_sjf_longest_passed_over_seconds"] == 0.0
    # Its predictions, made at admission, tell a 2-token answer from a 60-token essay.
    assert warm["serve_sjf_predictor_mae_tokens"] < (LONG - SHORT) / 4

    async def run() -> list[str]:
        finished: list[str] = []
        async with httpx.AsyncClient(base_url=server.v1, timeout=60) as client:

            async def complete(name: str, max_tokens: int) -> None:
                resp = await client.post("/completions", json=body(max_tokens))
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["completion_tokens"] == max_tokens
                finished.append(name)

            stream = body(4 * LONG, stream=True)
            async with client.stream("POST", "/completions", json=stream) as first:
                chunks = first.aiter_lines()
                while not (await anext(chunks)).startswith("data: {"):
                    pass  # the first essay holds the seat
                second = asyncio.create_task(complete("second essay", LONG))
                await asyncio.sleep(0.05)  # it waits behind the first, which came earlier
                await complete("answer", SHORT)
                async for _ in chunks:
                    pass
            finished.append("first essay")
            await second
        return finished

    finished = asyncio.run(run())
    # The answer came last and finished first: it passed over both essays.
    assert finished.index("answer") < finished.index("second essay")
    after = wait_until_idle(server)
    assert after["serve_sjf_longest_passed_over_seconds"] > 0.0
