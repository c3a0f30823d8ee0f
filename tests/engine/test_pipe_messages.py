"""What crosses the pipe from a core process: a step's deltas as MessagePack, the rest
pickled, and `decode_reply` telling them apart. Every field a delta can carry comes back
equal, of the same types (int keys of top logprobs, the finish reason's enum)."""

from __future__ import annotations

import pickle

from serve.engine.messages import CoreFailed, RequestFailed, decode_reply, encode_step
from serve.outputs import RequestTimes
from serve.scheduler.output_deltas import RequestDelta, SeqDelta
from serve.sequence import FinishReason


def test_a_step_of_every_kind_of_delta_comes_back_equal():
    step = [
        RequestDelta("cmpl-1", [SeqDelta(0, [17], None, None)], False),
        RequestDelta(
            "cmpl-2",
            [
                SeqDelta(0, [3, 4], [-0.25, -1.5], [{3: -0.25, 9: -2.0}, {4: -1.5}], ranks=[1, 17]),
                SeqDelta(2, [8], [-0.125], None, FinishReason.STOP, stop_reason=8),
            ],
            False,
            prompt_logprobs=[None, {5: -3.0, 6: -0.5}],
            prompt_ranks=[None, 2],
        ),
        RequestDelta(
            "beam-3",
            [SeqDelta(1, [1, 2, 3], [], None, FinishReason.LENGTH, cumulative_logprob=-4.75)],
            True,
            times=RequestTimes(queue_s=0.5, prefill_s=0.25, decode_s=2.0),
        ),
        RequestDelta("embd-4", [], True, pooled=[0.1, -0.2, 0.3]),
        RequestDelta("cmpl-5", [], True, error="the core failed this request"),
    ]
    back = decode_reply(encode_step(step))
    assert back == step
    assert isinstance(back[1].seqs[1].finish_reason, FinishReason)
    assert list(back[1].seqs[0].top_logprobs[0]) == [3, 9]  # int keys, in order
    assert isinstance(back[2].times, RequestTimes)


def test_an_empty_step_and_pickled_replies_decode_too():
    assert decode_reply(encode_step([])) == []
    for message in (RequestFailed("r", "bad", True), CoreFailed("ValueError", "no model")):
        assert decode_reply(pickle.dumps(message)) == message
