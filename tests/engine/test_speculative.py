"""Speculative decoding (n-gram) through the engine: greedy output is the same tokens,
text and logprobs as without it, over staggered mixed batches with preemption, prefix-cache
hits, chunked prefill, n > 1, sampling controls and structured output; stops and
max_tokens inside an accepted run emit nothing past them; disable_by_batch_size.

The tiny random models rarely repeat themselves, so most requests here restrict the
vocabulary (`allowed_token_ids`) and repeat their prompts: greedy output over a few
tokens falls into loops that prompt lookup predicts, and each test that is about accepted
proposals asserts that some were accepted.
"""

from __future__ import annotations

import random
import re

import pytest
from tiny_models import random_prompts

from serve import LLM, SamplingParams
from serve.outputs import RequestOutput
from serve.sampling_params import StructuredOutputsParams

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
# allowed_token_ids ('co', 'em', 'ion', 'ou', 'ow', 'ver'): greedy output over these loops.
FEW = list(range(300, 306))
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def _llm(model_dir, speculative: dict | None, **kwargs) -> LLM:
    kwargs = {"block_size": 4, "kv_cache_memory": "8MiB", "swap_space": 0.001, **kwargs}
    if speculative is not None:
        kwargs["speculative_config"] = speculative
    return LLM(model=str(model_dir), **kwargs)


def _drive(llm: LLM, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]):
    """Add each request at its step (others running meanwhile), step until all finish,
    checking the block manager's invariants after every step; the final outputs by id."""
    manager = llm.engine.block_manager
    finals: dict[str, RequestOutput] = {}
    step = 0
    while step <= max(arrivals) or llm.has_unfinished_requests():
        for request_id, prompt, params in arrivals.get(step, []):
            llm.add_request(request_id, prompt, params)
        for out in llm.step():
            if out.finished:
                finals[out.request_id] = out
        manager.check_invariants()
        step += 1
        assert step < 2000, "requests never finished"
    assert manager.num_free_blocks == manager.num_blocks
    return finals


def _assert_same(spec: dict[str, RequestOutput], plain: dict[str, RequestOutput]) -> None:
    assert spec.keys() == plain.keys()
    for request_id, expected in plain.items():
        got = spec[request_id]
        assert got.error is None and expected.error is None
        assert len(got.outputs) == len(expected.outputs)
        for a, b in zip(got.outputs, expected.outputs):
            assert a.token_ids == b.token_ids, request_id
            assert a.text == b.text, request_id
            assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason), request_id
            assert (a.logprobs is None) == (b.logprobs is None)
            if b.logprobs is not None:
                assert len(a.logprobs) == len(b.logprobs)
                for got_top, want_top in zip(a.logprobs, b.logprobs):
                    assert got_top.keys() == want_top.keys(), request_id
                    for token, value in want_top.items():
                        assert got_top[token] == pytest.approx(value, abs=1e-4), request_id


def _mixed_arrivals() -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    """Requests arriving over the first steps: repetitive prompts that share a 16-token
    prefix (prefix-cache hits), small-vocabulary greedy ones, penalties with bias and
    min_tokens, n=2, logprobs, an unrestricted one and a JSON schema one."""
    prefix = random_prompts(512, 1, 16, 16, seed=5)[0]
    tails = random_prompts(512, 6, 4, 12, seed=6)
    repetitive = [prefix + tail * 3 for tail in tails]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, allowed_token_ids=FEW)
    controls = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        allowed_token_ids=FEW + [0],  # 0 is EOS: masked until min_tokens
        presence_penalty=0.3,
        frequency_penalty=0.2,
        repetition_penalty=1.2,
        logit_bias={301: 1.5, 304: -0.5},
        min_tokens=25,
    )
    two = SamplingParams(
        temperature=0.0, n=2, max_tokens=30, ignore_eos=True, allowed_token_ids=FEW
    )
    with_logprobs = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, allowed_token_ids=FEW, logprobs=3
    )
    unrestricted = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
    json_schema = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    return {
        0: [("greedy-0", repetitive[0], greedy), ("controls-0", repetitive[1], controls)],
        2: [("two", repetitive[2], two), ("json", prefix + tails[3], json_schema)],
        5: [("logprobs", repetitive[3], with_logprobs), ("greedy-1", repetitive[4], greedy)],
        9: [("unrestricted", repetitive[5], unrestricted), ("controls-1", repetitive[0], controls)],
    }


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        # 48 blocks x 4 tokens for 8 requests (9 sequences) of up to ~90 tokens: preemption.
        pytest.param({"num_gpu_blocks_override": 48}, id="preemption"),
        # Prompts of up to 52 tokens in chunks of at most 16 tokens a step, decodes included.
        pytest.param({"max_num_batched_tokens": 16, "max_num_seqs": 6}, id="chunked-prefill"),
    ],
)
def test_greedy_output_is_unchanged_over_a_staggered_mixed_batch(tiny_llama, engine_kwargs):
    arrivals = _mixed_arrivals()
    plain_llm = _llm(tiny_llama, None, **engine_kwargs)
    plain = _drive(plain_llm, arrivals)
    spec_llm = _llm(tiny_llama, NGRAM, **engine_kwargs)
    spec = _drive(spec_llm, arrivals)
    _assert_same(spec, plain)

    stats = spec_llm.stats()
    assert stats.spec_decode.num_draft_tokens > 0
    assert stats.spec_decode.num_accepted_tokens > 0
    assert stats.prefix_cache_hits > 0
    if "num_gpu_blocks_override" in engine_kwargs:
        assert stats.num_preemptions > 0
    # The two samples of n=2 at temperature 0 are the same greedy tokens.
    assert spec["two"].outputs[0].token_ids == spec["two"].outputs[1].token_ids
    # min_tokens held through the accepted runs: EOS came no earlier than allowed.
    assert all(len(spec[r].outputs[0].token_ids) >= 25 for r in ("controls-0", "controls-1"))
    assert '"a"' in spec["json"].outputs[0].text


def test_penalties_apply_at_every_checked_position(tiny_llama):
    """Greedy with every penalty, bias and min_tokens: the same tokens as without
    speculation, with proposals accepted (so the controls saw them counted as output)."""
    prompt = random_prompts(512, 1, 6, 6, seed=8)[0] * 4
    params = SamplingParams(
        temperature=0.0,
        max_tokens=60,
        allowed_token_ids=[300, 301, 302, 0],
        presence_penalty=0.3,
        frequency_penalty=0.2,
        repetition_penalty=1.2,
        logit_bias={302: 1.5},
        min_tokens=50,
    )
    arrivals = {0: [("r", prompt, params)]}
    plain = _drive(_llm(tiny_llama, None), arrivals)
    spec_llm = _llm(tiny_llama, NGRAM)
    spec = _drive(spec_llm, arrivals)
    _assert_same(spec, plain)
    assert len(plain["r"].outputs[0].token_ids) >= 50
    assert spec_llm.stats().spec_decode.num_accepted_tokens > 0


def _steps(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams):
    """Run one request alone: its final output and its output's length after each step."""
    lengths, final = [], None
    llm.add_request(request_id, prompt, params)
    while llm.has_unfinished_requests():
        for out in llm.step():
            lengths.append(len(out.outputs[0].token_ids))
            if out.finished:
                final = out
        llm.engine.block_manager.check_invariants()
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    return final, lengths


def _accepted_positions(lengths: list[int]) -> list[int]:
    """Output positions that a step took as accepted proposals: all of a step's tokens
    but its last (the one sampled after them)."""
    positions, before = [], 0
    for length in lengths:
        positions += range(before, length - 1)
        before = length
    return positions


@pytest.fixture(scope="module")
def looping(tiny_llama):
    """Speculating and plain engines, and a repetitive prompt whose small-vocabulary greedy
    output the n-gram proposer predicts in runs: (spec llm, plain llm, prompt, params,
    the output without limits, the positions it took as accepted proposals)."""
    spec, plain = _llm(tiny_llama, NGRAM), _llm(tiny_llama, None)
    # FEW's tokens in the prompt let a token's first occurrence in the output be a
    # proposal copied from the prompt (one a stop token can end the output at).
    shuffled = [303, 300, 304, 301, 305, 302]
    prompt = (random_prompts(512, 1, 5, 5, seed=13)[0] + shuffled) * 2
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, allowed_token_ids=FEW)
    out, lengths = _steps(spec, "unlimited", prompt, params)
    accepted = _accepted_positions(lengths)
    assert len(accepted) >= 10  # runs of accepted proposals to put stops in
    return spec, plain, prompt, params, out.outputs[0].token_ids, accepted


def _with(params: SamplingParams, **changes) -> SamplingParams:
    fields = {
        "temperature": params.temperature,
        "max_tokens": params.max_tokens,
        "ignore_eos": params.ignore_eos,
        "allowed_token_ids": params.allowed_token_ids,
    }
    return SamplingParams(**{**fields, **changes})


def test_stop_token_inside_an_accepted_run_ends_the_output_there(looping):
    spec, plain, prompt, params, tokens, accepted = looping
    # An accepted proposal that is its token's first occurrence: with it as a stop token,
    # the step's later tokens (at least the one sampled after the proposals) are dropped.
    firsts = [i for i in accepted if tokens[i] not in tokens[:i]]
    assert firsts, "no accepted proposal is its token's first occurrence"
    position = firsts[0]
    stop = _with(params, stop_token_ids=[tokens[position]])
    drafts_before = spec.stats().spec_decode.num_accepted_tokens
    got, _ = _steps(spec, "stop-token", prompt, stop)
    want = plain.generate({"prompt_token_ids": prompt}, stop, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids == tokens[: position + 1]
    assert got.outputs[0].text == want.outputs[0].text
    assert (got.outputs[0].finish_reason, got.outputs[0].stop_reason) == ("stop", tokens[position])
    assert spec.stats().spec_decode.num_accepted_tokens > drafts_before


def test_stop_string_inside_an_accepted_run_ends_the_text_there(looping):
    spec, plain, prompt, params, tokens, accepted = looping
    tokenizer = spec.get_tokenizer()
    full_text = tokenizer.decode(tokens)
    # Two tokens' text whose first occurrence ends with an accepted proposal that is not
    # its step's last token.
    position = None
    for i in accepted:
        if i < 1 or i + 1 not in accepted:
            continue
        stop_text = tokenizer.decode(tokens[i - 1 : i + 1])
        if stop_text.strip() and full_text.find(stop_text) + len(stop_text) == len(
            tokenizer.decode(tokens[: i + 1])
        ):
            position = i
            break
    assert position is not None, "no stop string ends inside an accepted run"
    stop = _with(params, stop=[stop_text])
    got, _ = _steps(spec, "stop-string", prompt, stop)
    want = plain.generate({"prompt_token_ids": prompt}, stop, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids == tokens[: position + 1]
    assert got.outputs[0].text == want.outputs[0].text
    assert got.outputs[0].text == full_text[: full_text.find(stop_text)]
    assert (got.outputs[0].finish_reason, got.outputs[0].stop_reason) == ("stop", stop_text)


def test_max_tokens_inside_an_accepted_run_gives_exactly_max_tokens(looping):
    spec, plain, prompt, params, tokens, accepted = looping
    ended_in_a_run = 0
    for max_tokens in range(2, 20):
        limited = _with(params, max_tokens=max_tokens)
        got, lengths = _steps(spec, f"max-{max_tokens}", prompt, limited)
        assert got.outputs[0].token_ids == tokens[:max_tokens]
        assert got.outputs[0].finish_reason == "length"
        ended_in_a_run += len(lengths) > 1 and lengths[-1] - lengths[-2] > 1
    want = plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert want.outputs[0].token_ids == tokens
    assert ended_in_a_run > 0  # some runs ended on accepted proposals


def test_a_grammar_start_sequence_inside_an_accepted_run(looping):
    """A grammar that starts after a token sequence (as GPT-OSS's answer header, several
    tokens) which the output first completes at an accepted proposal: the proposals stop
    before that token, which ends its step, and the grammar holds what follows exactly as
    without speculation; the tokens before it are the free model's."""
    spec, plain, prompt, params, tokens, accepted = looping
    stream = prompt + tokens
    position = None
    for i in (i for i in accepted if i >= 2):
        sequence = tuple(tokens[i - 2 : i + 1])
        ends = (
            j for j in range(len(prompt), len(stream)) if tuple(stream[j - 2 : j + 1]) == sequence
        )
        if next(ends) == len(prompt) + i:  # the first that ends in the output
            position = i
            break
    assert position is not None, "no three tokens first end at an accepted proposal"
    # A grammar over two of the allowed tokens that the free model does not write next.
    tokenizer = spec.get_tokenizer()
    held = [t for t in FEW if t not in tokens[position + 1 : position + 4]][:2]
    regex = "(" + "|".join(re.escape(tokenizer.decode([t])) for t in held) + ")+"
    grammar = StructuredOutputsParams(regex=regex, start_after_token_ids=sequence)
    constrained = _with(params, structured_outputs=grammar)
    got, lengths = _steps(spec, "grammar-start", prompt, constrained)
    want = plain.generate({"prompt_token_ids": prompt}, constrained, use_tqdm=False)[0]
    got_tokens = got.outputs[0].token_ids
    assert got_tokens == want.outputs[0].token_ids
    assert got_tokens[: position + 1] == tokens[: position + 1]
    assert len(got_tokens) == params.max_tokens and set(got_tokens[position + 1 :]) <= set(held)
    assert position + 1 in lengths  # the sequence's last token ended its step


def test_disable_by_batch_size_stops_drafts_while_the_batch_is_larger(tiny_llama):
    llm = _llm(tiny_llama, {**NGRAM, "disable_by_batch_size": 2})
    prompts = [p * 3 for p in random_prompts(512, 4, 5, 5, seed=12)]
    max_tokens = [8, 10, 40, 40]
    arrivals = {
        0: [
            (
                f"r{i}",
                p,
                SamplingParams(
                    temperature=0.0, max_tokens=m, ignore_eos=True, allowed_token_ids=FEW
                ),
            )
            for i, (p, m) in enumerate(zip(prompts, max_tokens))
        ]
    }
    drafts_while_four, drafts_at_most_two = 0, 0
    manager = llm.engine.block_manager
    for request_id, prompt, params in arrivals[0]:
        llm.add_request(request_id, prompt, params)
    finals = {}
    while llm.has_unfinished_requests():
        before = llm.stats()
        for out in llm.step():
            if out.finished:
                finals[out.request_id] = out
        manager.check_invariants()
        new_drafts = llm.stats().spec_decode.num_drafts - before.spec_decode.num_drafts
        if before.num_running + before.num_waiting == 4:
            drafts_while_four += new_drafts
        if before.num_running + before.num_waiting <= 2:
            drafts_at_most_two += new_drafts
    assert drafts_while_four == 0
    assert drafts_at_most_two > 0
    plain = _drive(_llm(tiny_llama, None), arrivals)
    _assert_same(finals, plain)


def test_a_seeded_samples_tokens_do_not_depend_on_its_neighbours(tiny_llama):
    """How many drafts a sequence gets depends on its neighbours (the token budget they
    leave, disable_by_batch_size), and the verifier's random draws follow the drafts: a
    seeded sample decodes plainly, so its tokens are those it gets alone."""
    llm = _llm(tiny_llama, NGRAM, max_num_batched_tokens=10)
    rng = random.Random(0)
    target = rng.sample(range(3, 512), 150)  # a sampled token often recurs in it: drafts
    others = [[rng.randrange(3, 512) for _ in range(3)] for _ in range(6)]
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=30, ignore_eos=True)
    (alone,) = llm.generate([target], seeded, use_tqdm=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    *_, beside = llm.generate(others + [target], [greedy] * 6 + [seeded], use_tqdm=False)
    assert beside.outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.stats().spec_decode.num_draft_tokens > 0  # the neighbours speculated
