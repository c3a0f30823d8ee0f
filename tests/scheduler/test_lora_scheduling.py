"""LoRA adapters in the scheduler: at most `max_loras` distinct adapters among the running
requests (the workers' slots for a step), requests of another adapter passed over
without holding back those behind them, and the prefix cache kept apart per adapter."""

from __future__ import annotations

from scheduler.harness import (
    add_all,
    make_group,
    make_scheduler,
    prompt_of,
    run_step,
    run_to_completion,
)

from serve.lora_request import LoRARequest


def _lora(i: int) -> LoRARequest:
    return LoRARequest(f"adapter-{i}", i, f"/adapters/{i}")


def _with_lora(group, lora):
    group.lora = lora
    for seq in group.seqs:
        seq.cache_key = lora.cache_key
    return group


def _running_loras(sched) -> set[int]:
    return {g.lora.lora_int_id for g in sched.running if g.lora is not None}


def test_a_third_adapter_waits_and_those_behind_it_start():
    sched = make_scheduler(max_loras=2, max_num_batched_tokens=64)
    one = _with_lora(make_group(0, prompt_of(0, 4), max_tokens=3), _lora(1))
    two = _with_lora(make_group(1, prompt_of(1, 4), max_tokens=8), _lora(2))
    three = _with_lora(make_group(2, prompt_of(2, 4), max_tokens=3), _lora(3))
    base = make_group(3, prompt_of(3, 4), max_tokens=3)
    one_again = _with_lora(make_group(4, prompt_of(4, 4), max_tokens=3), _lora(1))
    add_all(sched, [one, two, three, base, one_again])
    run_step(sched)
    assert set(sched.running) == {one, two, base, one_again}
    assert list(sched.waiting) == [three]  # passed over, still first in line
    steps = 1
    while three not in sched.running:
        assert len(_running_loras(sched)) <= 2
        run_step(sched)
        steps += 1
    # It starts once adapter 1's requests are done (adapter 2's still runs).
    assert one.is_finished and one_again.is_finished and not two.is_finished
    assert _running_loras(sched) == {2, 3}
    outs = run_to_completion(sched)
    assert all(len(g.seqs[0].output_token_ids) > 0 for g in [one, two, three, base, one_again])
    assert outs  # the rest ran to the end (the harness checked each step's mirror holds
    # every sequence's adapter, as the workers learn it with the prompt)


def test_prefix_cache_matches_only_under_the_same_adapter():
    sched = make_scheduler(max_loras=2, block_size=4)
    prompt = prompt_of(0, 13)
    first = _with_lora(make_group(0, prompt, max_tokens=1), _lora(1))
    add_all(sched, [first])
    run_to_completion(sched)
    other = _with_lora(make_group(1, prompt, max_tokens=1), _lora(2))
    base = make_group(2, prompt, max_tokens=1)
    same = _with_lora(make_group(3, prompt, max_tokens=1), _lora(1))
    for group in (other, base, same):
        add_all(sched, [group])
        run_to_completion(sched)
    assert [g.num_cached_tokens for g in (other, base, same)] == [0, 0, 12]
