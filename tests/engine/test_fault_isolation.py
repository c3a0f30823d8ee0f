"""A fault while the engine processes one request fails that request alone: it ends with
an error and frees its blocks, and every other request's tokens are what they would have
been without it. Faults are injected where a request's own data is handled: adding it,
sampling it and advancing its grammar (in the worker), building its token deltas and
its beam search (in the scheduler), and decoding its text (in the front end's output
processor, which then aborts it in the core)."""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import random_prompts

from serve import LLM, RequestsFailedError, SamplingParams
from serve.config import EngineConfig
from serve.engine.async_engine import AsyncEngine
from serve.engine.detokenizer import IncrementalDetokenizer
from serve.engine.protocol import RequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
POISON = 77  # the first prompt token of the request whose processing raises


class InjectedFault(RuntimeError):
    pass


def _poisoned(seq) -> bool:
    return seq.prompt_token_ids[0] == POISON


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), max_model_len=128, kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def healthy_prompts():
    return [p for p in random_prompts(512, 3, 4, 20, seed=11) if p[0] != POISON]


@pytest.fixture(scope="module")
def expected(llm, healthy_prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in healthy_prompts], GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outs]


def _run_with_poison(llm, healthy_prompts, params=GREEDY):
    poison = [POISON, 5, 9, 13, 2, 40]
    prompts = [*healthy_prompts[:1], poison, *healthy_prompts[1:]]
    with pytest.raises(RequestsFailedError, match="failed 1 of") as raised:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    outs = raised.value.outputs
    failed = outs.pop(1)
    return failed, outs


def _all_token_ids(outs) -> list[list[list[int]]]:
    """Each request's completions' token ids."""
    return [[c.token_ids for c in out.outputs] for out in outs]


def _step_sampler(llm):
    """The worker's sampling end (the uniproc executor's one worker)."""
    return llm.engine.executor.worker.model_runner.step_sampler


def _assert_isolated(llm, failed, healthy, expected):
    assert failed.finished
    assert failed.error is not None and "InjectedFault" in failed.error
    assert [out.error for out in healthy] == [None] * len(healthy)
    assert [out.outputs[0].token_ids for out in healthy] == expected
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # The worker forgets the failed request's sequences with the next step it runs (the
    # last request's own, ended by its length, with the step after).
    llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)
    assert not _step_sampler(llm).sampler._seq_generators
    mirrored = engine.executor.worker.model_runner.mirror.seqs.values()
    assert [seq.prompt_token_ids for seq in mirrored] in ([], [[1, 2, 3]])


def test_a_fault_decoding_one_requests_text(llm, healthy_prompts, expected, monkeypatch):
    update = IncrementalDetokenizer.update

    def faulty_update(self, output_token_ids):
        if self.prompt_token_ids[0] == POISON and len(output_token_ids) == 3:
            raise InjectedFault("cannot decode")
        return update(self, output_token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "update", faulty_update)
    failed, healthy = _run_with_poison(llm, healthy_prompts)
    _assert_isolated(llm, failed, healthy, expected)
    assert failed.outputs == []
    assert llm.output_processor.num_requests == 0


def test_a_fault_sampling_one_request_fails_it_not_its_batch(
    llm, healthy_prompts, expected, monkeypatch
):
    sampler = _step_sampler(llm).sampler
    process_logits = sampler.process_logits

    def faulty_process_logits(logits, seqs, mask):
        if any(_poisoned(seq) and seq.num_output_tokens == 2 for seq in seqs):
            raise InjectedFault("bad sampling parameters")
        return process_logits(logits, seqs, mask)

    monkeypatch.setattr(sampler, "process_logits", faulty_process_logits)
    failed, healthy = _run_with_poison(llm, healthy_prompts)
    _assert_isolated(llm, failed, healthy, expected)


def test_a_fault_building_one_output(llm, healthy_prompts, expected, monkeypatch):
    scheduler = llm.engine.scheduler
    build = scheduler._delta

    def faulty_delta(group):
        if _poisoned(group.seqs[0]) and group.is_finished:
            raise InjectedFault("cannot build the output")
        return build(group)

    monkeypatch.setattr(scheduler, "_delta", faulty_delta)
    failed, healthy = _run_with_poison(llm, healthy_prompts)
    _assert_isolated(llm, failed, healthy, expected)


def test_a_fault_in_one_parallel_sampling_request(llm, healthy_prompts, monkeypatch):
    """n=3 forks after the prompt: a fault decoding one of the forks' text ends the request
    and frees every sibling's blocks."""
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)
    expected = _all_token_ids(
        llm.generate([{"prompt_token_ids": p} for p in healthy_prompts], params, use_tqdm=False)
    )
    update = IncrementalDetokenizer.update
    poisoned: list[IncrementalDetokenizer] = []  # the poisoned request's, in sample order

    def faulty_update(self, output_token_ids):
        if self.prompt_token_ids[0] == POISON:
            if self not in poisoned:
                poisoned.append(self)
            if poisoned.index(self) == 2:
                raise InjectedFault("third sample")
        return update(self, output_token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "update", faulty_update)
    failed, healthy = _run_with_poison(llm, healthy_prompts, params)
    assert failed.error is not None and "InjectedFault" in failed.error
    assert _all_token_ids(healthy) == expected
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_a_fault_in_one_beam_search(llm, healthy_prompts, monkeypatch):
    params = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=6)
    expected = _all_token_ids(
        llm.generate([{"prompt_token_ids": p} for p in healthy_prompts], params, use_tqdm=False)
    )
    engine, scheduler = llm.engine, llm.engine.scheduler
    beam_step = scheduler._beam_step

    def faulty_beam_step(group, candidates):
        if _poisoned(group.seqs[0]) and group.seqs[0].num_output_tokens == 3:
            raise InjectedFault("beam scores")
        return beam_step(group, candidates)

    monkeypatch.setattr(scheduler, "_beam_step", faulty_beam_step)
    failed, healthy = _run_with_poison(llm, healthy_prompts, params)
    assert failed.error is not None and "InjectedFault" in failed.error
    assert _all_token_ids(healthy) == expected
    assert not scheduler._beam_searches
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_fault_in_one_grammar(llm, healthy_prompts, monkeypatch):
    """The grammar matcher raising on one request's token fails that request; another
    request with its own grammar runs on."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    from serve.sampling_params import StructuredOutputsParams

    params = SamplingParams(
        temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(json=schema)
    )
    manager = _step_sampler(llm).grammars.get()
    accept = manager.accept
    poisoned_ids = set()

    def faulty_accept(seq_id, token):
        if seq_id in poisoned_ids:
            raise InjectedFault("matcher state")
        return accept(seq_id, token)

    add_request = llm.engine.add_request

    def tracking_add(request_id, prompt_token_ids, p, prompt=None, **kwargs):
        add_request(request_id, prompt_token_ids, p, prompt, **kwargs)
        if prompt_token_ids[0] == POISON:
            poisoned_ids.add(llm.engine.scheduler.get_group(request_id).seqs[0].seq_id)

    clean = llm.generate({"prompt_token_ids": healthy_prompts[0]}, params, use_tqdm=False)
    monkeypatch.setattr(manager, "accept", faulty_accept)
    monkeypatch.setattr(llm.engine, "add_request", tracking_add)
    failed, healthy = _run_with_poison(llm, healthy_prompts[:1], params)
    assert failed.error is not None and "InjectedFault" in failed.error
    assert healthy[0].outputs[0].token_ids == clean[0].outputs[0].token_ids
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_fault_adding_one_request_through_the_loop(tiny_llama, monkeypatch):
    """Through the engine loop (as the server runs it): an unexpected error while adding
    a request fails that request with RequestError; the others complete."""
    engine = AsyncEngine.from_config(
        EngineConfig.create(str(tiny_llama), max_model_len=128, kv_cache_memory="8MiB")
    )
    check = engine.core.scheduler.check

    def faulty_check(group):
        if _poisoned(group.seqs[0]):
            raise InjectedFault("cannot check its size")
        return check(group)

    monkeypatch.setattr(engine.core.scheduler, "check", faulty_check)
    prompts = random_prompts(512, 2, 4, 12, seed=3)

    async def final(request_id, prompt):
        last = None
        async for out in engine.generate(request_id, prompt, GREEDY):
            last = out
        return last

    async def run():
        return await asyncio.gather(
            final("a", prompts[0]),
            final("poisoned", [POISON, 1, 2]),
            final("b", prompts[1]),
            return_exceptions=True,
        )

    try:
        a, poisoned, b = asyncio.run(run())
        assert isinstance(poisoned, RequestError), poisoned
        assert "InjectedFault: cannot check its size" in str(poisoned)
        assert len(a.outputs[0].token_ids) == len(b.outputs[0].token_ids) == 10
        assert engine.is_alive
        manager = engine.core.block_manager
        assert manager.num_free_blocks == manager.num_blocks
        assert engine.core.scheduler.get_group("poisoned") is None
    finally:
        engine.shutdown()
