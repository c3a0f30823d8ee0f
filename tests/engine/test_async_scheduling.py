"""Async scheduling schedules each step, and builds the step before's token deltas, while
the forward pass before it runs, and changes no token: the same outputs (text and stop
strings included, decoded by the front end) as one step at a time, whatever ends the
requests, and whatever the scheduler does to sequences still in flight (preempts them,
swaps them out, ends them)."""

from __future__ import annotations

import pytest
from tiny_models import random_prompts

from serve import LLM, SamplingParams


def _run(model_dir, async_scheduling: bool, prompts, params, **kwargs):
    kwargs = {"kv_cache_memory": "8MiB", **kwargs}
    llm = LLM(
        model=str(model_dir),
        swap_space=0.001,
        max_num_batched_tokens=48,  # several steps of chunks beside the decodes
        async_scheduling=async_scheduling,
        **kwargs,
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.block_pool.num_used_blocks == 0
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs], llm.engine


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_same_outputs_as_serial_steps(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(512, 10, 3, 90, seed=13)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=15),
        SamplingParams(temperature=0.0, max_tokens=25, stop=["e"]),  # a stop string
        SamplingParams(temperature=0.0, max_tokens=25, stop=["the", "a"]),
        SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[300, 301, 302]),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4, stop=[" "]),
        SamplingParams(temperature=0.0, best_of=3, use_beam_search=True, max_tokens=10),
        SamplingParams(temperature=0.7, seed=9, max_tokens=30, frequency_penalty=1.0),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]
    serial, _ = _run(model_dir, False, prompts, params)
    overlapped, engine = _run(model_dir, True, prompts, params)
    assert overlapped == serial
    assert any(r[0][2] == "stop" for r in serial)  # the stop strings did end some
    assert engine.step_times.num_steps_ahead > 0


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_steps_scheduled_ahead_under_preemption(tiny_llama, preemption_mode):
    """A cache of 24 blocks for 8 requests: the step scheduled ahead preempts sequences
    that the running step is still computing and sampling. Shared prefixes bring the
    prefix cache in; stop tokens and lengths end sequences that are already in the next
    step."""
    shared = random_prompts(512, 1, 12, 12, seed=1)[0]
    prompts = [
        {"prompt_token_ids": (shared if i % 2 else []) + p}
        for i, p in enumerate(random_prompts(512, 8, 3, 20, seed=4))
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=list(range(300, 340))),
        SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, min_tokens=10, stop_token_ids=[5, 9]),
    ] * 2
    kwargs = {
        "num_gpu_blocks_override": 24,
        "block_size": 4,
        "preemption_mode": preemption_mode,
        "enable_prefix_caching": True,
    }
    serial, _ = _run(tiny_llama, False, prompts, params, **kwargs)
    overlapped, engine = _run(tiny_llama, True, prompts, params, **kwargs)
    assert overlapped == serial
    times = engine.step_times
    assert times.num_steps_ahead >= times.num_steps // 2, times
    assert engine.scheduler.num_preemptions > 0
    assert any(r[0][2] == "stop" for r in serial)


def test_between_steps_only_the_steps_in_flight_hold_tokens(tiny_llama):
    """Between steps, two are in flight: the one that ran (its output not yet taken in)
    and the one scheduled ahead. Each running or swapped sequence's scheduled-but-
    uncomputed tokens are exactly its share of those two, and its pending tokens the ones
    they sample, through preemptions, swaps and stops."""
    llm = LLM(
        model=str(tiny_llama),
        swap_space=0.001,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=20,
        block_size=4,
        preemption_mode="swap",
    )
    engine, scheduler = llm.engine, llm.engine.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[300, 301, 302])
    for i, prompt in enumerate(random_prompts(512, 6, 3, 24, seed=8)):
        llm.add_request(f"r{i}", prompt, params)
    num_checked = 0
    while llm.has_unfinished_requests():
        llm.step()
        steps = [engine._in_flight[0]] if engine._in_flight is not None else []
        steps += [engine._ahead] if engine._ahead is not None else []
        for group in scheduler.running + scheduler.swapped:
            for seq in group.live_seqs:
                shares = [s for out in steps for s in out.scheduled if s.seq_id == seq.seq_id]
                assert seq.num_scheduled_tokens == sum(s.num_new_tokens for s in shares)
                assert seq.num_pending_tokens == sum(s.is_sampled for s in shares)
                if shares:
                    assert shares[0].start == seq.num_computed_tokens
                num_checked += len(shares) == 2
    assert num_checked > 0  # sequences were in both steps at once
    assert engine.step_times.num_steps_ahead > 0 and scheduler.num_preemptions > 0
    assert engine.block_manager.block_pool.num_used_blocks == 0


def test_abort_between_sampling_and_building_deltas(tiny_llama):
    llm = LLM(model=str(tiny_llama), kv_cache_memory="8MiB", swap_space=0.001)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = random_prompts(512, 3, 5, 20, seed=2)
    for i, prompt in enumerate(prompts):
        llm.add_request(f"r{i}", prompt, params)
    llm.step()
    llm.step()
    assert engine._in_flight is not None  # sampled; its deltas are built next step
    assert engine._ahead is not None  # and the next step, r1 in it, is scheduled
    aborted = llm.abort_request("r1")
    assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert set(finished) == {"r0", "r2"}
    engine.block_manager.check_invariants()
    assert engine.block_manager.block_pool.num_used_blocks == 0
    alone = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
    assert finished["r0"] == alone[0].outputs[0].token_ids
