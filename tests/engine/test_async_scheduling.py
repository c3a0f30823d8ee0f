"""Async scheduling builds each step's token deltas while the next forward pass runs, and
changes no token: the same outputs (text and stop strings included, decoded by the front
end) as one step at a time, whatever ends the requests."""

from __future__ import annotations

import pytest
from tiny_models import random_prompts

from serve import LLM, SamplingParams


def _run(model_dir, async_scheduling: bool, prompts, params):
    llm = LLM(
        model=str(model_dir),
        kv_cache_memory="8MiB",
        swap_space=0.001,
        max_num_batched_tokens=48,  # several steps of chunks beside the decodes
        async_scheduling=async_scheduling,
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.block_pool.num_used_blocks == 0
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


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
    serial = _run(model_dir, False, prompts, params)
    overlapped = _run(model_dir, True, prompts, params)
    assert overlapped == serial
    assert any(r[0][2] == "stop" for r in serial)  # the stop strings did end some


def test_abort_between_sampling_and_building_deltas(tiny_llama):
    llm = LLM(model=str(tiny_llama), kv_cache_memory="8MiB", swap_space=0.001)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = random_prompts(512, 3, 5, 20, seed=2)
    for i, prompt in enumerate(prompts):
        llm.add_request(f"r{i}", prompt, params)
    llm.step()
    llm.step()
    assert engine._unemitted is not None  # sampled; its deltas are built next step
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
