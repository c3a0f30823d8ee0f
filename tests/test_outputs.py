"""RequestOutput.add_delta: a lagging reader's queued DELTA outputs joined into one."""

from __future__ import annotations

from serve.outputs import CompletionOutput, RequestOutput


def _delta(finished: bool, *completions: CompletionOutput) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], list(completions), finished)


def test_joined_deltas_carry_each_sample_whole_and_the_later_finish():
    first = _delta(
        False,
        CompletionOutput(0, "The", [10], -0.5, [{10: -0.5}], ranks=[3]),
        CompletionOutput(1, "A", [20], -0.25, [{20: -0.25}]),
    )
    first.add_delta(_delta(False, CompletionOutput(1, " big", [21], -1.0, [{21: -0.75}])))
    first.add_delta(
        _delta(
            True,
            CompletionOutput(
                0, " sea", [11, 12], -2.0, [{11: -1.0}, {12: -0.5}], "stop", ".", [1, 9]
            ),
            CompletionOutput(2, "One", [30], -0.1, [{30: -0.1}], "length"),
        )
    )
    by_index = {c.index: c for c in first.outputs}
    assert (by_index[0].text, by_index[0].token_ids) == ("The sea", [10, 11, 12])
    assert by_index[0].logprobs == [{10: -0.5}, {11: -1.0}, {12: -0.5}]
    assert by_index[0].ranks == [3, 1, 9]
    assert (by_index[0].cumulative_logprob, by_index[0].finish_reason) == (-2.0, "stop")
    assert by_index[0].stop_reason == "."
    assert (by_index[1].text, by_index[1].token_ids, by_index[1].finish_reason) == (
        "A big",
        [20, 21],
        None,
    )
    assert by_index[2].text == "One" and by_index[2].finish_reason == "length"
    assert first.finished
