"""Chunked prefill through the engine: long prompts split into chunks of several sizes
(boundaries mid-block, after a prefix-cache hit) decode exactly as HF does; chunking off
gives the same tokens; a long prompt never holds up running decodes; and the startup
check that refuses a token budget no prompt-sized step fits when chunking is off."""

from __future__ import annotations

import functools
from typing import NamedTuple

import pytest
from tiny_models import hf_greedy, random_prompts

from serve import LLM, SamplingParams
from serve.api.cli import build_parser

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Long prompts (the tiny models' context is 512) mixed with short ones.
PROMPTS = [
    *random_prompts(512, 1, 280, 280, seed=21),
    *random_prompts(512, 3, 3, 20, seed=22),
    *random_prompts(512, 1, 130, 130, seed=23),
]


def _llm(model_dir, **kwargs) -> LLM:
    # A small swap space keeps check_invariants (which walks the CPU pool too) cheap.
    kwargs = {"kv_cache_memory": "8MiB", "swap_space": 0.001, **kwargs}
    return LLM(model=str(model_dir), **kwargs)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@functools.cache
def _hf(model_dir, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(model_dir, list(prompt), MAX_TOKENS, ignore_eos=True)


def _assert_matches_hf(model_dir, prompts, got) -> None:
    for i, (prompt, tokens) in enumerate(zip(prompts, got, strict=True)):
        assert tokens == _hf(model_dir, tuple(prompt)), f"prompt {i} diverged from HF"


class Scheduled(NamedTuple):
    """One sequence's part of a step, as the scheduler decided it."""

    request_id: str
    start: int  # the first position the step computes
    num_new_tokens: int
    is_sampled: bool


def _record_steps(llm: LLM, monkeypatch) -> list[list[Scheduled]]:
    """What each step of `llm`'s engine schedules from now on, requests admitted into a
    step scheduled ahead included; checks the budgets and the block manager's invariants
    after each schedule and each such admission."""
    scheduler = llm.engine.scheduler
    schedule, admit_arrivals = scheduler.schedule, scheduler.admit_arrivals
    steps: list[list[Scheduled]] = []
    index: dict[int, int] = {}  # id of a recorded step's output -> its place in `steps`

    def check_and_list(out) -> list[Scheduled]:
        assert out.num_batched_tokens <= scheduler.max_num_batched_tokens
        assert out.num_seqs <= scheduler.max_num_seqs
        scheduler.block_manager.check_invariants()
        return [
            Scheduled(
                scheduler.get_seq(s.seq_id).request_id, s.start, s.num_new_tokens, s.is_sampled
            )
            for s in out.scheduled
        ]

    def recording_schedule():
        out = schedule()
        index[id(out)] = len(steps)
        steps.append(check_and_list(out))
        return out

    def recording_admit_arrivals(out):
        num_scheduled = len(out.scheduled)
        admit_arrivals(out)
        if len(out.scheduled) == num_scheduled:
            return
        if id(out) in index:
            steps[index[id(out)]] = check_and_list(out)
        else:  # scheduled ahead before the recording began: the first step it sees run
            index[id(out)] = len(steps)
            steps.append(check_and_list(out))

    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    monkeypatch.setattr(scheduler, "admit_arrivals", recording_admit_arrivals)
    return steps


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(("budget", "block_size"), [(17, 16), (32, 8), (64, 16), (100, 8)], ids=str)
def test_long_prompts_in_chunks_match_hf(tiny_model_factory, monkeypatch, arch, budget, block_size):
    model_dir = tiny_model_factory(arch)
    llm = _llm(model_dir, block_size=block_size, max_num_batched_tokens=budget)
    steps = _record_steps(llm, monkeypatch)
    got = _greedy(llm, PROMPTS)
    _assert_matches_hf(model_dir, PROMPTS, got)
    chunks = [s for step in steps for s in step if not s.is_sampled]
    assert chunks, "no prompt was split"
    assert any((s.start + s.num_new_tokens) % block_size for s in chunks)  # mid-block


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_chunking_off_gives_the_same_tokens(tiny_model_factory, monkeypatch, arch):
    model_dir = tiny_model_factory(arch)
    llm = _llm(model_dir, block_size=16, enable_chunked_prefill=False)
    engine = llm.engine
    assert engine.max_num_batched_tokens >= engine.max_model_len  # the default fits a prompt
    steps = _record_steps(llm, monkeypatch)
    got = _greedy(llm, PROMPTS)
    assert all(s.is_sampled for step in steps for s in step)  # never split
    assert got == _greedy(_llm(model_dir, block_size=16, max_num_batched_tokens=32), PROMPTS)
    _assert_matches_hf(model_dir, PROMPTS, got)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefix_cache_hit_then_chunks_matches_hf(tiny_model_factory, monkeypatch, arch):
    """The second prompt shares the first's 3 full blocks (48 tokens), then 150 more: it
    starts after the hit and computes its remainder in 17-token chunks."""
    model_dir = tiny_model_factory(arch)
    first = random_prompts(512, 1, 53, 53, seed=31)[0]
    second = first[:48] + random_prompts(512, 1, 150, 150, seed=32)[0]
    llm = _llm(model_dir, block_size=16, max_num_batched_tokens=17)
    got = _greedy(llm, [first])
    hits = llm.stats().prefix_cache_hits
    steps = _record_steps(llm, monkeypatch)
    got += _greedy(llm, [second])
    assert llm.stats().prefix_cache_hits - hits == 48
    chunks = [s for step in steps for s in step if s.num_new_tokens > 1]
    assert [(s.start, s.num_new_tokens) for s in chunks[:2]] == [(48, 17), (65, 17)]
    assert len(chunks) == -(-150 // 17)
    _assert_matches_hf(model_dir, [first, second], got)


def test_a_long_prompt_never_holds_up_sixteen_decodes(tiny_llama, monkeypatch):
    """16 requests decode while a 300-token prompt arrives: every step of its prefill
    carries every still-running decode (one token each), and its chunk takes the rest of
    the 64-token budget, so no decode waits behind the whole prompt."""
    budget = 64
    llm = _llm(tiny_llama, block_size=16, max_num_batched_tokens=budget, max_num_seqs=32)
    short = random_prompts(512, 16, 2, 3, seed=41)
    (long,) = random_prompts(512, 1, 300, 300, seed=42)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(short):
        llm.add_request(f"d{i}", prompt, params)
    llm.step()  # every short prompt fits the first step
    finished: dict[str, list[int]] = {}
    steps = _record_steps(llm, monkeypatch)
    llm.add_request("long", long, params)
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids

    chunk = budget - 16
    steps = [step for step in steps if step]  # async scheduling's last look finds nothing
    prefill = [step for step in steps if step[-1].request_id == "long" and step[-1].start < 300]
    assert [step[-1].start for step in prefill] == list(range(0, 300, chunk))
    assert prefill == steps[: len(prefill)]  # from its arrival on, one chunk a step
    for step in prefill:
        *decodes, long_chunk = step
        assert [(s.request_id, s.num_new_tokens) for s in decodes] == [
            (f"d{i}", 1) for i in range(16)
        ]
        assert long_chunk.num_new_tokens == min(chunk, 300 - long_chunk.start)
    assert finished["long"] == hf_greedy(tiny_llama, long, 12, ignore_eos=True)
    assert finished["d0"] == hf_greedy(tiny_llama, short[0], 12, ignore_eos=True)


def test_chunking_off_refuses_a_budget_below_max_model_len(tiny_llama):
    with pytest.raises(ValueError, match="--max-num-batched-tokens to at least 512"):
        _llm(tiny_llama, enable_chunked_prefill=False, max_num_batched_tokens=64)
    # A context that fits the budget is fine.
    llm = _llm(
        tiny_llama, enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64
    )
    assert llm.engine.max_num_batched_tokens == 64


def test_cli_flag():
    parser = build_parser()
    assert parser.parse_args([]).enable_chunked_prefill is True
    assert parser.parse_args(["--no-enable-chunked-prefill"]).enable_chunked_prefill is False
