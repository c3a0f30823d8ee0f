"""OutputStreams: a request's outputs handed from the receiving thread to its reader. A
reader that keeps up gets one output per step; one that fell behind gets what queued up
as one output (cumulative outputs: the newest; deltas: joined), so nothing is lost; and
an error queued behind outputs it had not read still reaches it, after them."""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import build_tokenizer

from serve import SamplingParams
from serve.engine.messages import AbortRequest, AddRequest
from serve.engine.output_streams import OutputStreams
from serve.engine.protocol import RequestError
from serve.outputs import OutputKind
from serve.scheduler.output_deltas import RequestDelta, SeqDelta
from serve.sequence import FinishReason

PROMPT_IDS = [5, 6, 7]
KINDS = pytest.mark.parametrize("kind", [OutputKind.CUMULATIVE, OutputKind.DELTA])


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _step(token_id: int, last: bool = False) -> list[RequestDelta]:
    finish = FinishReason.LENGTH if last else None
    return [RequestDelta("r", [SeqDelta(0, [token_id], None, None, finish)], last)]


async def _read(
    streams: OutputStreams, feed, kind: OutputKind
) -> tuple[list, BaseException | None]:
    """Start reading request "r", let `feed(streams)` run while the reader waits, then
    read to the end: the outputs it got and the error that ended it."""
    add = AddRequest("r", PROMPT_IDS, SamplingParams(max_tokens=8), None)
    reader = streams.generate(add, output_kind=kind)
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


@KINDS
def test_a_reader_that_fell_behind_gets_one_output_with_every_token(tokenizer, kind):
    ids = tokenizer.encode("The sea is wide", add_special_tokens=False)
    sent: list = []

    def feed(streams):  # every step arrives before the reader runs again
        for i, token_id in enumerate(ids):
            streams.put_step(_step(token_id, last=i == len(ids) - 1))

    outputs, error = asyncio.run(_read(OutputStreams(tokenizer, sent.append), feed, kind))
    assert error is None
    assert len(outputs) == 1  # one read, one output: the finished one
    final = outputs[0]
    assert final.finished and final.outputs[0].token_ids == ids
    assert final.outputs[0].text == tokenizer.decode(ids)
    assert not any(isinstance(c, AbortRequest) for c in sent)  # it finished: no abort


@KINDS
def test_a_reader_that_keeps_up_gets_every_step(tokenizer, kind):
    ids = tokenizer.encode("The sea is wide", add_special_tokens=False)

    async def run():
        streams = OutputStreams(tokenizer, lambda command: None)
        add = AddRequest("r", PROMPT_IDS, SamplingParams(max_tokens=8), None)
        reader = streams.generate(add, output_kind=kind)
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
    if kind is OutputKind.CUMULATIVE:
        assert [o.outputs[0].token_ids for o in seen] == [ids[: i + 1] for i in range(len(ids))]
    else:  # each step's token alone; the texts add up to the whole
        assert [o.outputs[0].token_ids for o in seen] == [[token_id] for token_id in ids]
        assert "".join(o.outputs[0].text for o in seen) == tokenizer.decode(ids)


@KINDS
def test_an_error_behind_unread_outputs_comes_after_them(tokenizer, kind):
    ids = tokenizer.encode("The sea", add_special_tokens=False)

    def feed(streams):
        for token_id in ids:
            streams.put_step(_step(token_id))
        streams.put("r", RequestError("the core failed this request"))
        streams.put_step(_step(ids[0]))  # after the error: never read

    outputs, error = asyncio.run(_read(OutputStreams(tokenizer, lambda command: None), feed, kind))
    assert isinstance(error, RequestError)
    assert [o.outputs[0].token_ids for o in outputs] == [ids]  # every token before the error
    assert not outputs[0].finished
