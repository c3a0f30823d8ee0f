"""OutputStreams: a request's outputs handed from the receiving thread to its reader. A
reader that keeps up gets one output per step; one that fell behind gets the newest
output alone (outputs are cumulative, so nothing is lost), and an error queued behind
outputs it had not read still reaches it, after them."""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import build_tokenizer

from serve import SamplingParams
from serve.engine.messages import AbortRequest, AddRequest
from serve.engine.output_streams import OutputStreams
from serve.engine.protocol import RequestError
from serve.scheduler.output_deltas import RequestDelta, SeqDelta
from serve.sequence import FinishReason

PROMPT_IDS = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _step(token_id: int, last: bool = False) -> list[RequestDelta]:
    finish = FinishReason.LENGTH if last else None
    return [RequestDelta("r", [SeqDelta(0, [token_id], None, None, finish)], last)]


async def _read(streams: OutputStreams, feed) -> tuple[list, BaseException | None]:
    """Start reading request "r", let `feed(streams)` run while the reader waits, then
    read to the end: the outputs it got and the error that ended it."""
    add = AddRequest("r", PROMPT_IDS, SamplingParams(max_tokens=8), None)
    reader = streams.generate(add)
    first = asyncio.ensure_future(reader.__anext__())
    await asyncio.sleep(0)  # the stream is registered; the reader waits on its queue
    feed(streams)
    outputs, error = [], None
    try:
        outputs.append(await first)
        async for output in reader:
            outputs.append(output)
    except Exception as e:
        error = e
    return outputs, error


def test_a_reader_that_fell_behind_gets_the_newest_output_with_every_token(tokenizer):
    ids = tokenizer.encode("The sea is wide", add_special_tokens=False)
    sent: list = []

    def feed(streams):  # every step arrives before the reader runs again
        for i, token_id in enumerate(ids):
            streams.put_step(_step(token_id, last=i == len(ids) - 1))

    outputs, error = asyncio.run(_read(OutputStreams(tokenizer, sent.append), feed))
    assert error is None
    assert len(outputs) == 1  # one read, one output: the finished one
    final = outputs[0]
    assert final.finished and final.outputs[0].token_ids == ids
    assert final.outputs[0].text == tokenizer.decode(ids)
    assert not any(isinstance(c, AbortRequest) for c in sent)  # it finished: no abort


def test_a_reader_that_keeps_up_gets_every_step(tokenizer):
    ids = tokenizer.encode("The sea is wide", add_special_tokens=False)

    async def run():
        streams = OutputStreams(tokenizer, lambda command: None)
        add = AddRequest("r", PROMPT_IDS, SamplingParams(max_tokens=8), None)
        reader = streams.generate(add)
        seen = []
        pending = asyncio.ensure_future(reader.__anext__())
        await asyncio.sleep(0)
        for i, token_id in enumerate(ids):
            streams.put_step(_step(token_id, last=i == len(ids) - 1))
            seen.append(await pending)  # read before the next step arrives
            if i < len(ids) - 1:
                pending = asyncio.ensure_future(reader.__anext__())
        return seen

    seen = asyncio.run(run())
    assert [len(o.outputs[0].token_ids) for o in seen] == list(range(1, len(ids) + 1))


def test_an_error_behind_unread_outputs_comes_after_them(tokenizer):
    ids = tokenizer.encode("The sea", add_special_tokens=False)

    def feed(streams):
        for token_id in ids:
            streams.put_step(_step(token_id))
        streams.put("r", RequestError("the core failed this request"))
        streams.put_step(_step(ids[0]))  # after the error: never read

    outputs, error = asyncio.run(_read(OutputStreams(tokenizer, lambda command: None), feed))
    assert isinstance(error, RequestError)
    assert [o.outputs[0].token_ids for o in outputs] == [ids]  # every token before the error
    assert not outputs[0].finished
