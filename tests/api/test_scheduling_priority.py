"""`priority` through the OpenAI API: refused (400) by a server that does not schedule by
it; under --scheduling-policy priority, a high-priority request sent while a full batch
of low-priority ones runs starts within a step or two (read from the steps the engine
scheduled, not from wall time)."""

from __future__ import annotations

import asyncio

import httpx
from api.openai_errors import assert_openai_error
from prometheus_client.parser import text_string_to_metric_families

from serve.api.server import build_app
from serve.api.settings import ServerSettings
from serve.config import EngineConfig
from serve.engine.async_engine import AsyncEngine

NUM_LOW = 64


def test_a_priority_is_a_400_on_a_server_that_schedules_fcfs(http, server):
    for path, body in (
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        ),
    ):
        resp = http.post(path, json={"model": server.model, "priority": 3, **body})
        error = assert_openai_error(resp, 400, param="priority")
        assert "--scheduling-policy priority" in error["message"]
        # Priority 0 is everyone's: accepted anywhere.
        ok = http.post(path, json={"model": server.model, "priority": 0, **body})
        assert ok.status_code == 200, ok.text


def test_a_high_priority_request_overtakes_a_full_batch(tiny_llama):
    config = EngineConfig.create(
        str(tiny_llama),
        max_model_len=256,
        kv_cache_memory="32MiB",
        max_num_seqs=NUM_LOW,
        scheduling_policy="priority",
    )
    engine = AsyncEngine.from_config(config)
    core = engine.core
    steps: list[set[str]] = []  # the requests each scheduled step computes
    arrivals: dict[str, int] = {}  # request id -> steps scheduled before the core had it
    schedule, add_request = core.scheduler.schedule, core.add_request

    def recording_schedule():
        out = schedule()
        seqs = (core.scheduler.get_seq(s.seq_id) for s in out.scheduled)
        steps.append({seq.request_id for seq in seqs if seq is not None})
        return out

    def recording_add_request(request_id, *args, **kwargs):
        arrivals[request_id] = len(steps)
        return add_request(request_id, *args, **kwargs)

    core.scheduler.schedule = recording_schedule
    core.add_request = recording_add_request
    app = build_app(engine, ServerSettings("tiny", str(tiny_llama), scheduling_policy="priority"))

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", timeout=120
        ) as client:

            def complete(priority: int, max_tokens: int):
                body = {
                    "prompt": "Once upon a time",
                    "max_tokens": max_tokens,
                    "priority": priority,
                }
                return client.post("/v1/completions", json={**body, "ignore_eos": True})

            low = [asyncio.create_task(complete(10, 80)) for _ in range(NUM_LOW)]
            while not any(len(step) == NUM_LOW for step in steps):  # the batch is full
                await asyncio.sleep(0.01)
            high = await complete(0, 4)
            assert high.status_code == 200, high.text
            assert high.json()["usage"]["completion_tokens"] == 4
            for resp in await asyncio.gather(*low):
                assert resp.status_code == 200
                assert resp.json()["usage"]["completion_tokens"] == 80
            while engine.core_stats is None or engine.core_stats.engine.num_running:
                await asyncio.sleep(0.05)  # the core reports once more when it idles
            metrics = (await client.get("/metrics")).text
        # Every request's wait was observed once, under its priority.
        counts = {
            s.labels["priority"]: s.value
            for family in text_string_to_metric_families(metrics)
            if family.name == "serve_request_queue_time_seconds"
            for s in family.samples
            if s.name.endswith("_count")
        }
        assert counts == {"0": 1, "10": NUM_LOW}

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    (high_id,) = [r for r in arrivals if list(arrivals).index(r) == NUM_LOW]
    first = next(i for i, step in enumerate(steps) if high_id in step)
    assert first - arrivals[high_id] <= 2, (first, arrivals[high_id])
    # It took a seat from a low-priority request, which was preempted and still finished.
    assert core.scheduler.num_preemptions >= 1
    assert len(steps[first]) <= NUM_LOW
