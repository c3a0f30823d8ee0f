"""EngineCoreClient: the engine core in its own process, behind AsyncEngine's interface.

Requests cross two pipes and come back equal to the offline engine's; an early close
aborts in the core; the API-side checks match the core's; start-up errors surface in the
parent as they were raised; a core that dies or is orphaned never leaves anyone hanging.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from tiny_models import hf_greedy, random_prompts

from serve import LLM, SamplingParams
from serve.config import EngineConfig
from serve.engine.core_client import EngineCoreClient
from serve.engine.protocol import EngineDeadError, EngineStartError
from serve.engine.validation import check_params
from serve.sampling_params import StructuredOutputsParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
DEATH_NOTICE_S = 2.0  # a dead core fails the requests in flight within this


def _config(model: Path, **overrides) -> EngineConfig:
    kwargs = dict(max_model_len=512, kv_cache_memory="8MiB", max_num_seqs=2)
    return EngineConfig.create(str(model), **{**kwargs, **overrides})


@pytest.fixture(scope="module")
def client(tiny_llama):
    client = EngineCoreClient(_config(tiny_llama))
    yield client
    client.shutdown()


@pytest.fixture
def own_client(tiny_llama):
    """A client for a test that kills or stops its core."""
    client = EngineCoreClient(_config(tiny_llama))
    yield client
    client.shutdown()


async def _final(engine, request_id: str, prompt: list[int], params=GREEDY):
    last = None
    async for out in engine.generate(request_id, prompt, params):
        last = out
    return last


def test_concurrent_requests_match_offline(client, tiny_llama):
    prompts = random_prompts(512, 5, 3, 30, seed=4)

    async def run():
        return await asyncio.gather(*(_final(client, f"r{i}", p) for i, p in enumerate(prompts)))

    outs = asyncio.run(run())
    offline = LLM(model=str(tiny_llama), kv_cache_memory="8MiB").generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in offline]
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in offline]
    assert [o.prompt_token_ids for o in outs] == prompts  # re-attached by the client
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def _texts(out) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]


def test_stop_strings_through_the_split_match_offline(tiny_llama):
    """Text and stop strings are decoded in this process from the core's token ids: the
    same outputs as offline, including a stop string that ends one of n=3 samples (its
    siblings run on in the core) and best_of, ranked at the end."""
    config = _config(tiny_llama, max_num_seqs=8)
    offline = LLM(model=str(tiny_llama), max_model_len=512, kv_cache_memory="8MiB", max_num_seqs=8)
    prompts = random_prompts(512, 3, 8, 20, seed=6)
    n3 = dict(n=3, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    (free,) = offline.generate({"prompt_token_ids": prompts[0]}, SamplingParams(**n3), False)
    stop = free.outputs[1].text[4:7]  # in sample 1's text only (the seed decides)
    params = [
        SamplingParams(**n3, stop=[stop]),
        SamplingParams(
            temperature=0.0, max_tokens=16, stop=["e", "a"], include_stop_str_in_output=True
        ),
        SamplingParams(n=2, best_of=3, temperature=1.0, seed=9, max_tokens=10, stop=[" "]),
    ]
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts], params, False)
    client = EngineCoreClient(config)

    async def run():
        return await asyncio.gather(
            *(_final(client, f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params)))
        )

    try:
        outs = asyncio.run(run())
    finally:
        client.shutdown()
    # Batches differ between the runs, so logprobs may differ in their last bits.
    assert [_texts(o) for o in outs] == [_texts(o) for o in expected]
    for out, offline_out in zip(outs, expected):
        for c, e in zip(out.outputs, offline_out.outputs):
            assert c.cumulative_logprob == pytest.approx(e.cumulative_logprob, abs=1e-4)
    # Sample 1 met its stop string; its siblings ran on in the core to max_tokens.
    assert [c.finish_reason for c in outs[0].outputs] == ["length", "stop", "length"]
    lengths = [len(c.token_ids) for c in outs[0].outputs]
    assert lengths[0] == lengths[2] == 16 > lengths[1]
    assert all(c.finish_reason == "stop" for o in outs[1:] for c in o.outputs)


def test_leaving_a_stream_early_aborts_it_in_the_core(client):
    """max_num_seqs is 2: an observer runs beside a request that is left after two outputs.
    A third request can start only once the left one is gone from the core, so the
    observer's length when it starts tells whether the abort arrived (a few tokens on) or
    not (the left request ran to its 400 tokens)."""
    observer_prompt, left_prompt, later_prompt = random_prompts(512, 3, 10, 20, seed=2)

    async def run() -> tuple[int, int]:
        observed = 0

        async def observe() -> None:
            nonlocal observed
            async for out in client.generate("observer", observer_prompt, LONG):
                observed = out.num_output_tokens

        observer = asyncio.create_task(observe())
        left = client.generate("left", left_prompt, LONG)
        await anext(left)
        await anext(left)
        await left.aclose()
        later = client.generate("later", later_prompt, GREEDY)
        await anext(later)
        observed_at_start = observed
        final = [out async for out in later][-1]
        await observer
        return observed_at_start, final.num_output_tokens

    observed_at_start, later_tokens = asyncio.run(run())
    assert later_tokens == GREEDY.max_tokens
    assert observed_at_start < LONG.max_tokens // 2, "the left request kept running"


def test_a_refused_request_fails_alone(client, tiny_llama):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            await _final(client, "too-long", [5] * 600)
        return await _final(client, "fine", [5, 6, 7])

    fine = asyncio.run(run())
    assert fine.finished and fine.outputs[0].finish_reason == "length"
    expected = hf_greedy(tiny_llama, [5, 6, 7], GREEDY.max_tokens, ignore_eos=True)
    assert fine.outputs[0].token_ids == expected  # the same as if it were alone


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(logprobs=21),
        SamplingParams(prompt_logprobs=30),
        SamplingParams(stop_token_ids=[512]),
        SamplingParams(logit_bias={700: 1.0}),
        SamplingParams(allowed_token_ids=[3, 600]),
    ],
)
def test_api_side_checks_are_the_cores(client, params):
    """The client checks with the core's function and the core's numbers (vocab 512,
    --max-logprobs 20), from the ready message."""
    with pytest.raises(ValueError) as in_core:
        check_params(params, 512, 20)
    with pytest.raises(ValueError, match=re.escape(str(in_core.value))):
        client.check_params(params)


def test_the_ready_message_describes_the_model(client, tiny_llama):
    assert (client.max_model_len, client.vocab_size, client.max_logprobs) == (512, 512, 20)
    assert client.model_path == tiny_llama
    with pytest.raises(ValueError, match=r"Prompt token ids must be in \[0, 512\)"):
        client.check_token_ids([1, 512], "Prompt token ids")
    client.check_token_ids([0, 511])
    assert client.tokenizer.decode([5, 6])


def test_invalid_grammar_is_refused_before_the_request(client):
    async def run():
        await client.compile_grammar(StructuredOutputsParams(regex="[0-9]{3}"))
        with pytest.raises(ValueError, match="(?i)regex"):
            await client.compile_grammar(StructuredOutputsParams(regex="[0-9"))

    asyncio.run(run())


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"model": "/no/such/model"}, FileNotFoundError, "not found"),
        ({"max_model_len": 100_000}, ValueError, "longer than this model supports"),
    ],
)
def test_start_up_errors_are_raised_in_the_parent(tiny_llama, overrides, error, message):
    model = overrides.pop("model", tiny_llama)
    before = set(_core_processes())
    with pytest.raises(error, match=message):
        EngineCoreClient(_config(model, **overrides))
    assert set(_core_processes()) == before  # the failed core has exited and been reaped


def test_a_core_killed_while_starting_is_reported_with_the_likely_cause(tiny_llama, monkeypatch):
    """A SIGKILL during start-up is most often the OOM killer: the error says so and where
    to look, as one line the CLI prints (an EngineStartError, not a bare RuntimeError)."""
    monkeypatch.setattr(
        "serve.engine.core_client.EngineCoreClient._next_message",
        lambda self: os.kill(self._process.pid, signal.SIGKILL) or self._process.join(),
    )
    with pytest.raises(EngineStartError) as info:
        EngineCoreClient(_config(tiny_llama))
    assert "exited while starting (killed by SIGKILL: most often the kernel's OOM killer" in str(
        info.value
    )


def _core_processes() -> list[psutil.Process]:
    children = psutil.Process().children()
    return [p for p in children if "spawn_main" in " ".join(p.cmdline())]


def test_a_killed_core_fails_requests_in_flight(own_client):
    prompt = random_prompts(512, 1, 10, 10, seed=3)[0]

    async def run() -> float:
        stream = own_client.generate("victim", prompt, LONG)
        await anext(stream)
        os.kill(own_client._process.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            async for _ in stream:
                pass
        return time.monotonic() - killed

    assert asyncio.run(run()) < DEATH_NOTICE_S
    assert not own_client.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(_final(own_client, "after", prompt))


def test_a_sigterm_to_the_process_group_leaves_the_core_to_its_parent(own_client, tiny_llama):
    """systemd (and `kill -TERM -PGID`) signals every process of the service: the core
    serves on, for the API process to drain it and then stop it."""
    prompt = random_prompts(512, 1, 10, 10, seed=3)[0]

    async def run():
        stream = own_client.generate("drained", prompt, GREEDY)
        first = await anext(stream)
        os.kill(own_client._process.pid, signal.SIGTERM)
        last = first
        async for out in stream:
            last = out
        return last

    final = asyncio.run(run())
    assert final.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, GREEDY.max_tokens)
    assert own_client.is_alive
    own_client.shutdown()
    assert own_client._process.exitcode == 0


def test_shutdown_stops_the_core_and_fails_requests_in_flight(own_client):
    prompt = random_prompts(512, 1, 10, 10, seed=3)[0]

    async def run() -> None:
        stream = own_client.generate("cut", prompt, LONG)
        await anext(stream)
        await asyncio.to_thread(own_client.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass

    asyncio.run(run())
    assert own_client._process.exitcode == 0
    assert not own_client.is_alive


_ORPHAN_PARENT = """
import sys, time
from serve.config import EngineConfig
from serve.engine.core_client import EngineCoreClient
client = EngineCoreClient(EngineConfig.create(sys.argv[1], max_model_len=64, kv_cache_memory="8MiB"))
print(client._process.pid, flush=True)
time.sleep(600)
"""


def test_the_core_exits_when_its_parent_dies(tiny_llama):
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_PARENT, str(tiny_llama)],
        stdout=subprocess.PIPE,
        text=True,
    )
    core = psutil.Process(int(parent.stdout.readline()))
    try:
        parent.kill()
        parent.wait()
        core.wait(timeout=10)  # raises TimeoutExpired if the core outlives its parent
    finally:
        parent.kill()
        if core.is_running():
            core.kill()
