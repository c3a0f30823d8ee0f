"""Step accounting: every step's time lands in one phase, and the phases add up to no
more than the wall time they were measured in (with async scheduling, everything but the
part done beside the forward pass)."""

from __future__ import annotations

import time

import pytest
from tiny_models import random_prompts

from serve import LLM, SamplingParams
from serve.outputs import StepTimes


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_step_times_cover_the_run(tiny_llama, async_scheduling):
    llm = LLM(
        model=str(tiny_llama),
        kv_cache_memory="8MiB",
        swap_space=0.001,
        async_scheduling=async_scheduling,
    )
    prompts = [{"prompt_token_ids": p} for p in random_prompts(512, 6, 4, 40, seed=5)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    before = StepTimes(**vars(llm.engine.step_times))
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    times = llm.engine.step_times.since(before)
    assert 10 <= times.num_steps <= 6 * 10  # at least one step per token, at most one per row
    phases = [times.schedule_s, times.prepare_s, times.forward_s, times.sample_s, times.output_s]
    assert all(t > 0 for t in phases), times
    assert (times.overlapped_s > 0) == async_scheduling
    assert times.total_s - times.overlapped_s <= elapsed
