"""Async scheduling schedules each step, and builds the step before's token deltas, while
the forward pass before it runs, and changes no token: the same outputs (text and stop
strings included, decoded by the front end) as one step at a time, whatever ends the
requests, and whatever the scheduler does to sequences still in flight (preempts them,
swaps them out, ends them)."""

from __future__ import annotations

import threading

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


def _record_steps(engine) -> list:
    """Wrap the executor so that every step the workers run is recorded, in order."""
    steps, execute = [], engine.executor.execute_model

    def recording(out):
        steps.append(out)
        return execute(out)

    engine.executor.execute_model = recording
    return steps


def _request_of(out, request_id: str) -> bool:
    return any(new.request_id == request_id for new in out.new_seqs)


def test_a_request_that_arrives_joins_the_step_scheduled_ahead(tiny_llama):
    """A request added while the next step is already scheduled starts in that step, not
    in the one after: the step had budget and seats to spare."""
    llm = LLM(model=str(tiny_llama), kv_cache_memory="8MiB", swap_space=0.001)
    engine = llm.engine
    steps = _record_steps(engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first, late = random_prompts(512, 2, 6, 20, seed=3)
    llm.add_request("first", first, params)
    llm.step()
    llm.step()
    assert engine._ahead is not None and not _request_of(engine._ahead, "late")
    llm.add_request("late", late, params)
    llm.step()
    assert _request_of(steps[-1], "late"), "the late request waited a step more"
    finished = {}
    while llm.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in llm.step() if o.finished})
    alone = LLM(model=str(tiny_llama), kv_cache_memory="8MiB", async_scheduling=False)
    expected = alone.generate({"prompt_token_ids": late}, params, use_tqdm=False)
    assert finished["late"] == expected[0].outputs[0].token_ids


def test_arrivals_between_steps_change_no_token(tiny_llama):
    """Requests added every few steps, some of them admitted into steps scheduled ahead,
    a few aborted: the same outputs as one step at a time."""
    prompts = random_prompts(512, 12, 3, 40, seed=21)
    params = [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=18, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=list(range(300, 330))),
    ]

    def run(async_scheduling: bool):
        llm = LLM(
            model=str(tiny_llama),
            num_gpu_blocks_override=40,
            block_size=4,
            max_num_batched_tokens=32,
            async_scheduling=async_scheduling,
        )
        finished, step, pending = {}, 0, list(enumerate(prompts))
        while pending or llm.has_unfinished_requests():
            if pending and step % 3 == 0:
                i, prompt = pending.pop(0)
                llm.add_request(f"r{i}", prompt, params[i % 3])
                if i % 5 == 4:
                    llm.abort_request(f"r{i - 1}")
            for out in llm.step():
                if out.finished:
                    finished[out.request_id] = (
                        out.outputs[0].token_ids,
                        out.outputs[0].finish_reason,
                    )
            step += 1
        llm.engine.block_manager.check_invariants()
        assert llm.engine.block_manager.block_pool.num_used_blocks == 0
        return finished

    serial, overlapped = run(False), run(True)
    completed = {k: v for k, v in serial.items() if v[1] != "abort"}
    assert {k: v for k, v in overlapped.items() if v[1] != "abort"} == completed
    assert len(completed) >= 8


def test_no_arrival_takes_blocks_an_aborted_sequence_still_writes(tiny_llama):
    """An abort frees a sequence's blocks at once, but the step scheduled ahead still
    computes that sequence and writes its K/V: a request arriving meanwhile must not be
    given those blocks in that same step."""
    llm = LLM(model=str(tiny_llama), num_gpu_blocks_override=12, block_size=4, swap_space=0.001)
    engine = llm.engine
    steps = _record_steps(engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # 5 blocks for the aborted one's 18 tokens and its decodes; the late one's 30 need 8,
    # more than the 7 blocks never used.
    doomed, late = (
        random_prompts(512, 1, 18, 18, seed=5)[0],
        random_prompts(512, 1, 30, 30, seed=6)[0],
    )
    llm.add_request("doomed", doomed, params)
    llm.step()
    llm.step()
    ahead = engine._ahead
    seq_id = next(s.seq_id for s in ahead.scheduled)
    held = set(engine.block_manager.get_block_table(seq_id))
    llm.abort_request("doomed")
    llm.add_request("late", late, params)
    llm.step()
    assert steps[-1] is ahead  # the step that still writes the aborted sequence's blocks
    late_seqs = [new.seq_id for new in ahead.new_seqs if new.request_id == "late"]
    given = {b for s in late_seqs for b in engine.block_manager.get_block_table(s)}
    assert not given & held, (
        "the late request writes blocks the step also writes for the aborted one"
    )
    finished = {}
    while llm.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in llm.step() if o.finished})
    assert len(finished["late"]) == 12
    engine.block_manager.check_invariants()


def test_deltas_are_delivered_while_the_next_step_runs(tiny_llama):
    """With `deliver`, a step's tokens reach the front end while the workers run the step
    after it (taken in on the helper thread), not when that step ends: each forward here
    waits for the step before's tokens and records whether they came."""
    llm = LLM(model=str(tiny_llama), kv_cache_memory="8MiB", swap_space=0.001)
    engine = llm.engine
    delivered: list = []
    came = threading.Event()
    arrived_during_forward: list[bool] = []
    execute = engine.executor.execute_model

    num_forwards = 0

    def forward_waiting_for_the_step_before(out):
        nonlocal num_forwards
        result = execute(out)
        if num_forwards and out.scheduled:  # the step before sampled tokens, due now
            arrived_during_forward.append(came.wait(timeout=5))
        came.clear()
        num_forwards += 1
        return result

    def deliver(deltas):
        assert threading.current_thread() is not threading.main_thread()
        delivered.extend(deltas)
        came.set()

    engine.executor.execute_model = forward_waiting_for_the_step_before
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(512, 2, 4, 12, seed=1)):
        llm.add_request(f"r{i}", prompt, params)
    returned = []
    while engine.has_unfinished_requests():
        returned += engine.step(deliver=deliver)
    assert arrived_during_forward and all(arrived_during_forward), str(arrived_during_forward)
    tokens = {}
    for delta in delivered + returned:
        for seq in delta.seqs:
            tokens.setdefault(delta.request_id, []).extend(seq.token_ids)
    assert {k: len(v) for k, v in tokens.items()} == {"r0": 6, "r1": 6}


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_a_request_its_length_ends_computes_no_token_past_it(tiny_llama, max_tokens):
    """The step scheduled ahead leaves out a sequence whose token being sampled is its
    last by `max_tokens`: it runs one prefill and max_tokens - 1 decodes, no more."""
    llm = LLM(model=str(tiny_llama), kv_cache_memory="8MiB", swap_space=0.001)
    steps = _record_steps(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    (prompt,) = random_prompts(512, 1, 6, 6, seed=4)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == max_tokens
    assert sum(bool(step.scheduled) for step in steps) == max_tokens
