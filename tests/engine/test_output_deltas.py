"""A core process sends only what changed in each output; the front end rebuilds the same
cumulative outputs, whatever the change: new tokens, new completions, text cut back by a
stop string, completions ranked at the end."""

from __future__ import annotations

import pickle
import random

from serve.engine.output_deltas import DeltaEncoder, apply_delta
from serve.outputs import CompletionOutput, RequestOutput

PROMPT, PROMPT_IDS = "Tell me", [5, 6, 7]


def _output(completions, finished=False, prompt_logprobs=None) -> RequestOutput:
    return RequestOutput("r", PROMPT, PROMPT_IDS, completions, finished, prompt_logprobs)


def _replay(outputs: list[RequestOutput]) -> list[RequestOutput]:
    encoder, last, rebuilt = DeltaEncoder(), None, []
    for out in outputs:
        delta = pickle.loads(pickle.dumps(encoder.encode(out)))  # as it crosses the pipe
        last = apply_delta(last, delta, PROMPT, PROMPT_IDS)
        rebuilt.append(last)
    assert not encoder._sent, "a finished request is forgotten"
    return rebuilt


def _growing(rng: random.Random, index: int, steps: int, logprobs: bool):
    tokens, text, lps, outs = [], "", [], []
    for _ in range(steps):
        tokens = [*tokens, rng.randrange(1000)]
        text = text + rng.choice(["", "a", " bc", "é"])  # some steps decode no text yet
        lps = [*lps, {tokens[-1]: -rng.random()}]
        outs.append(
            CompletionOutput(index, text, tokens, -len(tokens) / 3, lps if logprobs else None)
        )
    return outs


def test_growing_outputs_with_logprobs_rebuild_exactly():
    rng = random.Random(0)
    first, second = _growing(rng, 0, 30, True), _growing(rng, 1, 30, True)
    outputs = [_output([a, b]) for a, b in zip(first, second)]
    outputs[-1] = _output([first[-1], second[-1]], finished=True)
    assert _replay(outputs) == outputs


def test_a_stop_string_cuts_text_already_sent():
    base = [
        CompletionOutput(0, "Hello wor", [1, 2, 3]),
        CompletionOutput(0, "Hello wo", [1, 2, 3, 4]),
    ]
    ended = CompletionOutput(0, "Hello", [1, 2, 3, 4], finish_reason="stop", stop_reason=" wo")
    outputs = [_output([base[0]]), _output([base[1]]), _output([ended], finished=True)]
    assert _replay(outputs) == outputs


def test_completions_that_appear_later_and_a_final_ranking_keep_their_order():
    one = CompletionOutput(0, "a", [1])
    forked = [CompletionOutput(i, "ab"[: i + 1], [1, i]) for i in range(3)]
    ranked = [
        CompletionOutput(i, t, [1, i, 9], cumulative_logprob=lp, finish_reason="length")
        for i, t, lp in [(2, "abz", -0.5), (0, "az", -1.0), (1, "abz", -2.0)]
    ]
    outputs = [_output([one]), _output(forked), _output(ranked, finished=True)]
    assert _replay(outputs) == outputs
    assert [c.index for c in _replay(outputs)[-1].outputs] == [2, 0, 1]


def test_prompt_logprobs_arrive_once_and_stay():
    prompt_lps = [None, {6: -1.0}, {7: -0.5}]
    steps = _growing(random.Random(1), 0, 3, False)
    outputs = [_output([c], prompt_logprobs=prompt_lps) for c in steps]
    outputs[-1].finished = True
    assert _replay(outputs) == outputs


def test_a_step_costs_its_new_tokens_not_the_whole_output():
    encoder = DeltaEncoder()
    tokens = list(range(1024))
    text = "word " * 1024
    encoder.encode(_output([CompletionOutput(0, text, tokens)]))
    step = _output([CompletionOutput(0, text + "more", [*tokens, 5])])
    delta_bytes = len(pickle.dumps(encoder.encode(step)))
    assert delta_bytes * 20 < len(pickle.dumps(step))


def test_an_aborted_request_is_forgotten():
    encoder = DeltaEncoder()
    encoder.encode(_output([CompletionOutput(0, "a", [1])]))
    encoder.forget("r")
    delta = encoder.encode(_output([CompletionOutput(0, "ab", [1, 2])]))
    assert delta.completions[0].token_start == 0  # a fresh start, whole
