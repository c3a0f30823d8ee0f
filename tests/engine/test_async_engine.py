"""AsyncEngine: one stream per request, abort on early exit, fail loudly when the loop dies."""

from __future__ import annotations

import asyncio
import time

import pytest
from tiny_models import hf_greedy, random_prompts

from serve import LLM, SamplingParams
from serve.config import EngineConfig
from serve.engine.async_engine import AsyncEngine, EngineDeadError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama):
    engine = AsyncEngine.from_config(
        EngineConfig.create(str(tiny_llama), max_model_len=128, kv_cache_memory="8MiB")
    )
    yield engine
    engine.shutdown()


async def _final(engine: AsyncEngine, request_id: str, prompt: list[int], params=GREEDY):
    last = None
    async for out in engine.generate(request_id, prompt, params):
        last = out
    return last


def _wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_concurrent_requests_match_offline(engine, tiny_llama):
    prompts = random_prompts(512, 5, 3, 30, seed=4)

    async def run():
        return await asyncio.gather(*(_final(engine, f"r{i}", p) for i, p in enumerate(prompts)))

    outs = asyncio.run(run())
    offline = LLM(model=str(tiny_llama), kv_cache_memory="8MiB").generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in offline]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_leaving_a_stream_early_aborts_and_frees_blocks(engine):
    prompt = random_prompts(512, 1, 20, 20, seed=1)[0]
    long_params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def read_two():
        stream = engine.generate("early", prompt, long_params)
        seen = [await anext(stream), await anext(stream)]
        await stream.aclose()
        return seen

    seen = asyncio.run(read_two())
    assert len(seen) == 2 and not seen[-1].finished
    manager = engine.core.block_manager
    _wait_until(lambda: not engine.core.has_unfinished_requests())
    _wait_until(lambda: manager.num_free_blocks == manager.num_blocks)


def test_invalid_prompt_fails_only_that_request(engine, tiny_llama):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            await _final(engine, "too-long", [5] * 200)
        return await _final(engine, "fine", [5, 6, 7])

    fine = asyncio.run(run())
    assert fine.finished and fine.outputs[0].finish_reason == "length"
    expected = hf_greedy(tiny_llama, [5, 6, 7], GREEDY.max_tokens, ignore_eos=True)
    assert fine.outputs[0].token_ids == expected  # the same as if it were alone


def test_engine_fault_fails_in_flight_requests_and_health(engine, monkeypatch):
    def broken_step(deliver=None):
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(engine.core, "step", broken_step)

    async def run():
        with pytest.raises(EngineDeadError, match="simulated device fault"):
            await _final(engine, "victim", [5, 6, 7])

    asyncio.run(run())
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(_final(engine, "after", [5, 6, 7]))
