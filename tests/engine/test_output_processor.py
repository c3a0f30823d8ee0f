"""The front end's output processor: text decoded from the core's token deltas, stop strings
applied (and the core told to stop what they end), outputs of each kind built (DELTA ones
add up to the cumulative one, holding back what a stop string could still cut).

Pure tests feed hand-made deltas; engine tests check a stop string in one of n=3 samples
against the same request without it, and the blocks the core frees for it."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import build_tokenizer, random_prompts

from serve import LLM, SamplingParams
from serve.engine.async_engine import AsyncEngine
from serve.engine.messages import AbortRequest, StopSequence
from serve.engine.output_processor import OutputProcessor
from serve.outputs import CompletionOutput, OutputKind
from serve.scheduler.output_deltas import RequestDelta, SeqDelta
from serve.sequence import FinishReason

PROMPT_IDS = [5, 6, 7]
LENGTH, STOP = FinishReason.LENGTH, FinishReason.STOP


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _processor(tokenizer, **params) -> OutputProcessor:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, PROMPT_IDS, SamplingParams(max_tokens=None, **params))
    return processor


def _token(index: int, token_id: int, finish=None, logprob: float | None = None) -> SeqDelta:
    """One new token; its logprob only when given (the core sends them to a request that
    needs them: SamplingParams.needs_logprobs)."""
    return SeqDelta(index, [token_id], None if logprob is None else [logprob], None, finish)


def _step(processor, *seqs: SeqDelta, finished: bool = False):
    return processor.process([RequestDelta("r", list(seqs), finished)])


def test_text_grows_token_by_token_and_outputs_are_snapshots(tokenizer):
    processor = _processor(tokenizer)
    ids = _ids(tokenizer, "The sea is wide and blue.")
    outputs = []
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        step = _step(processor, _token(0, token_id, LENGTH if last else None), finished=last)
        assert step.to_core == []
        outputs += step.outputs
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, len(ids) + 1))
    final = outputs[-1].outputs[0]
    assert final.text == "The sea is wide and blue." and final.finish_reason == "length"
    assert final.cumulative_logprob is None  # nothing asked for logprobs, none ranked
    assert outputs[-1].finished and processor.num_requests == 0


def test_a_final_only_request_gives_its_finished_output_alone(tokenizer):
    """A response that is not streamed keeps only the last output: no snapshot per step,
    and the one it gets is the streamed request's last, stop strings applied."""
    ids = _ids(tokenizer, "The sea is wide and blue.")
    streamed, final_only = OutputProcessor(tokenizer), OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=None, stop=["blue"])
    streamed.add_request("r", None, PROMPT_IDS, params)
    final_only.add_request("r", None, PROMPT_IDS, params, OutputKind.FINAL_ONLY)
    outputs = {streamed: [], final_only: []}
    for processor in outputs:
        for token_id in ids:
            step = _step(processor, _token(0, token_id))
            outputs[processor] += step.outputs
            if step.to_core:  # the stop string ended it here
                break
    assert len(outputs[streamed]) > 1 and len(outputs[final_only]) == 1
    (last,) = outputs[final_only]
    assert last.finished and last.outputs[0].text == "The sea is wide and " == (
        outputs[streamed][-1].outputs[0].text
    )
    assert last.outputs[0].token_ids == outputs[streamed][-1].outputs[0].token_ids


WORDS = ["The", "sea", "is", "wide", "and", "blue.", "café", "naïve", "über", "wave"]
STOPS = ["sea", "e w", "blue", "and b", "ï", "xyz", "wave"]


@settings(max_examples=40, deadline=None)
@given(
    words=st.lists(
        st.lists(st.sampled_from(WORDS), min_size=1, max_size=10), min_size=1, max_size=2
    ),
    stop=st.lists(st.sampled_from(STOPS), max_size=2),
    tokens_a_step=st.integers(1, 3),
    logprobs=st.booleans(),
)
def test_deltas_add_up_to_the_cumulative_output(tokenizer, words, stop, tokens_a_step, logprobs):
    """A streamed response sends each DELTA output as it comes: joined, they are the
    cumulative output's last, token for token (with its logprobs and rank), char for
    char; no text is handed out that a stop string found later cuts; the finish comes
    once, last."""
    ids = [_ids(tokenizer, " ".join(w)) for w in words]
    params = SamplingParams(
        max_tokens=None, n=len(ids), stop=stop or None, logprobs=0 if logprobs else None
    )
    outputs: dict[OutputKind, list] = {OutputKind.CUMULATIVE: [], OutputKind.DELTA: []}
    for kind, got in outputs.items():
        processor = OutputProcessor(tokenizer)
        processor.add_request("r", None, PROMPT_IDS, params, kind)
        longest = max(len(seq) for seq in ids)
        for start in range(0, longest, tokens_a_step):
            seqs = []
            for index, seq in enumerate(ids):
                new = seq[start : start + tokens_a_step]
                if new:
                    end = LENGTH if start + tokens_a_step >= len(seq) else None
                    lps = [-0.5] * len(new) if logprobs else None
                    top = [{t: -0.5} for t in new] if logprobs else None
                    ranks = [t % 7 + 1 for t in new] if logprobs else None
                    seqs.append(SeqDelta(index, new, lps, top, end, ranks=ranks))
            got += processor.process(
                [RequestDelta("r", seqs, start + tokens_a_step >= longest)]
            ).outputs
    finals = {c.index: c for c in outputs[OutputKind.CUMULATIVE][-1].outputs}
    assert outputs[OutputKind.DELTA][-1].finished
    assert not any(out.finished for out in outputs[OutputKind.DELTA][:-1])
    for index, final in finals.items():
        deltas = [c for out in outputs[OutputKind.DELTA] for c in out.outputs if c.index == index]
        assert "".join(d.text for d in deltas) == final.text
        assert [t for d in deltas for t in d.token_ids] == final.token_ids
        if logprobs:
            assert [lp for d in deltas for lp in d.logprobs] == final.logprobs
            assert [r for d in deltas for r in d.ranks] == final.ranks
            assert final.ranks == [t % 7 + 1 for t in final.token_ids]
            assert deltas[-1].cumulative_logprob == pytest.approx(final.cumulative_logprob)
        assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [
            final.finish_reason
        ]
        assert deltas[-1].stop_reason == final.stop_reason


def test_a_delta_holds_back_what_could_begin_a_stop_string(tokenizer):
    """ " b" comes two tokens before "lu" and "e" make it "blue": the stream waits with the
    text's last three characters, so it never sends " b" and then finds it cut."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, PROMPT_IDS, SamplingParams(stop=["blue"]), OutputKind.DELTA)
    sent = []
    for token_id in _ids(tokenizer, "The sea is wide and blue."):
        sent += [out.outputs[0].text for out in _step(processor, _token(0, token_id)).outputs]
    assert "".join(sent) == "The sea is wide and "
    assert sent[-3:] == ["an", "d ", ""]  # three characters held back: " b", then "blu"


@pytest.mark.parametrize(("params", "needs"), [({"logprobs": 0}, True), ({"n": 2}, False)])
def test_cumulative_logprob_only_for_requests_that_need_logprobs(tokenizer, params, needs):
    processor = _processor(tokenizer, **params)
    num_seqs = params.get("n", 1)
    ids = _ids(tokenizer, "The sea is")
    logprobs = [-0.25 * (i + 1) for i in range(len(ids))]
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        deltas = [
            _token(s, token_id, LENGTH if last else None, logprobs[i] if needs else None)
            for s in range(num_seqs)
        ]
        outputs = _step(processor, *deltas, finished=last).outputs
    (out,) = outputs
    assert out.finished and len(out.outputs) == num_seqs
    for c in out.outputs:
        assert c.cumulative_logprob == (pytest.approx(sum(logprobs)) if needs else None)
        assert (c.logprobs is not None) == ("logprobs" in params)


def test_a_stop_string_ends_a_lone_sequence_with_an_abort(tokenizer):
    processor = _processor(tokenizer, stop=[" wide"])
    ids = _ids(tokenizer, "The sea is wide and blue.")
    steps = [_step(processor, _token(0, t)) for t in ids]
    ended = next(i for i, s in enumerate(steps) if s.to_core)
    assert steps[ended].to_core == [AbortRequest("r")]
    (out,) = steps[ended].outputs
    assert out.finished and out.outputs[0].text == "The sea is"
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", " wide")
    assert all(s.outputs == [] and s.to_core == [] for s in steps[ended + 1 :])  # dropped


def test_a_stop_string_in_one_of_two_stops_only_it(tokenizer):
    processor = _processor(tokenizer, n=2, stop=["sea"])
    pairs = list(zip(_ids(tokenizer, "The sea is"), _ids(tokenizer, "A sky is wide")))
    to_core = []
    for a, b in pairs:
        to_core += _step(processor, _token(0, a), _token(1, b)).to_core
    assert to_core == [StopSequence("r", 0)]
    # The core sampled on before it stopped sequence 0: those tokens are dropped.
    step = _step(processor, _token(0, 99), _token(1, 42, LENGTH))
    assert step.to_core == [AbortRequest("r")]  # the core has not ended the request yet
    (out,) = step.outputs
    one, two = out.outputs
    assert (one.text, one.finish_reason, one.stop_reason) == ("The ", "stop", "sea")
    assert 99 not in one.token_ids
    assert two.token_ids == [b for _, b in pairs] + [42] and two.finish_reason == "length"


def test_a_stop_string_in_the_last_token_wins_over_length(tokenizer):
    processor = _processor(tokenizer, stop=["blue"])
    ids = _ids(tokenizer, "wide and blue")
    for token_id in ids[:-1]:
        _step(processor, _token(0, token_id))
    step = _step(processor, _token(0, ids[-1], LENGTH), finished=True)
    assert step.to_core == []  # the core ended it already
    c = step.outputs[0].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("wide and ", "stop", "blue")


def test_min_tokens_holds_stop_strings_back(tokenizer):
    ids = _ids(tokenizer, "a sea, a sea, a sky")
    processor = _processor(tokenizer, stop=["sea"], min_tokens=len(_ids(tokenizer, "a sea, a")))
    texts = [o.outputs[0].text for t in ids for o in _step(processor, _token(0, t)).outputs]
    assert texts[-1] == "a sea, a "  # the first "sea" came too early


def test_the_token_that_makes_min_tokens_completes_no_stop_string(tokenizer):
    """vLLM's rule: a stop string must end in text after the first min_tokens tokens."""
    ids = _ids(tokenizer, "a sea, a sea, a sky")
    processor = _processor(tokenizer, stop=["sea"], min_tokens=len(_ids(tokenizer, "a sea")))
    texts = [o.outputs[0].text for t in ids for o in _step(processor, _token(0, t)).outputs]
    assert texts[-1] == "a sea, a "  # the first "sea" ended with the min_tokens-th token


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_token_finish_is_not_searched_for_stop_strings(tokenizer, include_stop):
    """The token that stopped the sequence is kept, its text only with
    include_stop_str_in_output (vLLM's rule), and never searched for a stop string."""
    processor = _processor(tokenizer, stop=["sea"], include_stop_str_in_output=include_stop)
    ids = _ids(tokenizer, "the sea")
    _step(processor, _token(0, ids[0]))
    last = SeqDelta(0, ids[1:], None, None, STOP, stop_reason=ids[-1])
    (out,) = _step(processor, last, finished=True).outputs
    c = out.outputs[0]
    assert c.token_ids == ids and c.finish_reason == "stop"
    expected_text = "the sea" if include_stop else tokenizer.decode(ids[:-1])
    assert (c.text, c.stop_reason) == (expected_text, ids[-1])


def test_a_stop_inside_a_multi_token_delta_drops_the_rest(tokenizer):
    processor = _processor(tokenizer, stop=["sea"], logprobs=1)
    ids = _ids(tokenizer, "The sea is wide")
    logprobs = [-0.1 * (i + 1) for i in range(len(ids))]
    top = [{t: lp} for t, lp in zip(ids, logprobs)]
    step = _step(processor, SeqDelta(0, ids, logprobs, top))
    kept = len(_ids(tokenizer, "The sea"))
    c = step.outputs[0].outputs[0]
    assert c.token_ids == ids[:kept] and c.logprobs == top[:kept]
    assert c.cumulative_logprob == pytest.approx(sum(logprobs[:kept]))
    assert step.to_core == [AbortRequest("r")]


def test_best_of_outputs_once_ranked(tokenizer):
    processor = _processor(tokenizer, n=1, best_of=3)
    for lp in (-1.0, -2.0):
        assert (
            _step(processor, *(_token(i, 40 + i, logprob=lp * (i + 1)) for i in range(3))).outputs
            == []
        )
    step = _step(
        processor, *(_token(i, 50, LENGTH, logprob=-0.1 * i) for i in range(3)), finished=True
    )
    (out,) = step.outputs
    (best,) = out.outputs
    assert best.index == 0 and best.token_ids == [40, 40, 50]  # sample 0 scored highest


def test_beam_results_are_decoded_whole(tokenizer):
    processor = _processor(tokenizer, n=2, best_of=2, use_beam_search=True, temperature=0.0)
    texts = ["the sea", "the sky"]
    hypotheses = [
        SeqDelta(i, _ids(tokenizer, t), [], None, LENGTH, cumulative_logprob=-1.0 - i)
        for i, t in enumerate(texts)
    ]
    (out,) = _step(processor, *hypotheses, finished=True).outputs
    assert [c.text for c in out.outputs] == texts
    assert [c.cumulative_logprob for c in out.outputs] == [-1.0, -2.0]


def test_a_core_error_fails_the_request(tokenizer):
    processor = _processor(tokenizer)
    step = processor.process([RequestDelta("r", [], True, error="it broke")])
    assert step.outputs[0].error == "it broke" and step.outputs[0].finished
    assert processor.num_requests == 0


# -- through the engine -----------------------------------------------------------------------


N3 = dict(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)


def _stop_for_one_sample(texts: list[str]) -> tuple[int, str]:
    """A short string that only one sample's text holds, after its first few characters."""
    for i, text in enumerate(texts):
        for start in range(4, len(text) // 2):  # well before its last token
            stop = text[start : start + 3]
            if stop.strip() and all(stop not in t for j, t in enumerate(texts) if j != i):
                return i, stop
    raise AssertionError(f"no string singles out one sample of {texts}")


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def prompt():
    return random_prompts(512, 1, 12, 12, seed=8)[0]


def test_a_stop_string_in_one_of_three_samples_stops_only_it(llm, tiny_llama, prompt):
    (full,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**N3), use_tqdm=False)
    index, stop = _stop_for_one_sample([c.text for c in full.outputs])
    params = SamplingParams(**N3, stop=[stop])
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    for c, whole in zip(out.outputs, full.outputs):
        if c.index == index:
            assert (c.finish_reason, c.stop_reason) == ("stop", stop)
            assert c.text == whole.text[: whole.text.index(stop)]
            assert c.token_ids == whole.token_ids[: len(c.token_ids)]
            assert len(c.token_ids) < len(whole.token_ids)
        else:  # the siblings run on to max_tokens, as without the stop string
            assert (c.token_ids, c.text, c.finish_reason) == (
                whole.token_ids,
                whole.text,
                "length",
            )
    manager = llm.engine.block_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks

    # The server's front end (here the in-process one) gives the same output.
    engine = AsyncEngine.from_config(llm.engine.config)

    async def final():
        outputs = [out async for out in engine.generate("n3", prompt, params)]
        return outputs[-1]

    try:
        served = asyncio.run(final())
    finally:
        engine.shutdown()
    # Its batches differ (the stop reaches the core later), so logprobs may differ in
    # their last bits; tokens and text do not.
    assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in served.outputs] == [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs
    ]


def test_the_core_frees_a_stopped_sequences_blocks(llm, prompt):
    (full,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**N3), use_tqdm=False)
    index, stop = _stop_for_one_sample([c.text for c in full.outputs])
    engine, manager = llm.engine, llm.engine.block_manager
    llm.add_request("r", prompt, SamplingParams(**N3, stop=[stop]))
    while True:
        outs = llm.step()
        manager.check_invariants()
        if outs and outs[0].outputs[index].finish_reason == "stop":
            break
    assert not outs[0].finished  # the siblings run on
    seqs = engine.scheduler.get_group("r").seqs
    stopped = seqs[index]
    assert stopped.is_finished and not manager.has_table(stopped.seq_id)
    assert all(manager.has_table(s.seq_id) for i, s in enumerate(seqs) if i != index)
    # The worker forgets it with the next step it runs (its random stream with it).
    runner = engine.executor.worker.model_runner
    for _ in range(2):
        llm.step()
    assert stopped.seq_id not in runner.step_sampler.sampler._seq_generators
    assert stopped.seq_id not in runner.mirror.seqs
    while llm.has_unfinished_requests():
        llm.step()
    assert manager.num_free_blocks == manager.num_blocks


def test_the_engine_gives_each_output_kind(llm, prompt):
    """What a response that is not streamed reads: one output, the cumulative one's last;
    what a streamed one reads: deltas that add up to it, sample by sample (n=3)."""
    params = SamplingParams(**N3)
    engine = AsyncEngine.from_config(llm.engine.config)

    async def outputs(request_id: str, kind: OutputKind) -> list:
        stream = engine.generate(request_id, prompt, params, output_kind=kind)
        return [out async for out in stream]

    async def every_kind():
        return await asyncio.gather(*(outputs(kind.value, kind) for kind in OutputKind))

    try:
        cumulative, delta, final = asyncio.run(every_kind())
    finally:
        engine.shutdown()

    def key(completions):
        return sorted((c.index, c.token_ids, c.text, c.finish_reason) for c in completions)

    assert len(cumulative) > 1 and len(final) == 1 and final[0].finished
    assert key(cumulative[-1].outputs) == key(final[0].outputs)
    joined: dict[int, CompletionOutput] = {}
    for out in delta:
        for c in out.outputs:
            if c.index not in joined:
                joined[c.index] = CompletionOutput(c.index, "", [])
            whole = joined[c.index]
            whole.text += c.text
            whole.token_ids += c.token_ids
            whole.finish_reason = c.finish_reason
    assert len(delta) > 1 and key(joined.values()) == key(final[0].outputs)


@pytest.mark.parametrize("kind", [OutputKind.DELTA, OutputKind.CUMULATIVE])
def test_prompt_logprobs_reach_a_delta_reader_once(tokenizer, kind):
    """Each DELTA output holds what is new, so the prompt's logprobs come with the first
    alone (as vLLM's do; they were repeated in every delta); each CUMULATIVE one has all."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, PROMPT_IDS, SamplingParams(prompt_logprobs=1), kind)
    prompt_logprobs = [None, {6: -0.5, 7: -1.0}, {7: -0.25}]
    prompt_ranks = [None, 1, 1]
    first = RequestDelta("r", [_token(0, 9)], False, prompt_logprobs, prompt_ranks)
    outputs = processor.process([first]).outputs
    for token_id in (10, 11):
        outputs += _step(processor, _token(0, token_id)).outputs
    assert [out.prompt_logprobs for out in outputs][0] == prompt_logprobs
    assert outputs[0].prompt_ranks == prompt_ranks
    later = [(out.prompt_logprobs, out.prompt_ranks) for out in outputs[1:]]
    if kind is OutputKind.DELTA:
        assert later == [(None, None)] * 2
    else:
        assert later == [(prompt_logprobs, prompt_ranks)] * 2
