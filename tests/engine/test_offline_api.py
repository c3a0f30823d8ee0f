"""The offline API's shapes, as vLLM users write them."""

from __future__ import annotations

import pytest
from tiny_models import hf_greedy
from tqdm import tqdm

from serve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), kv_cache_memory="8MiB")


def test_prompt_forms(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer("The sea is wide").input_ids
    params = SamplingParams(temperature=0.0, max_tokens=5)
    by_text, by_ids, by_dict = llm.generate(
        ["The sea is wide", ids, {"prompt_token_ids": ids}], params, use_tqdm=False
    )
    assert by_text.prompt == "The sea is wide" and by_text.prompt_token_ids == ids
    assert (
        by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids
    )
    single = llm.generate(ids, params, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == by_ids.outputs[0].token_ids
    text = by_text.outputs[0].text
    assert text == tokenizer.decode(by_text.outputs[0].token_ids, skip_special_tokens=True)


def test_stop_strings_and_stop_token_ids(llm):
    prompt = "Hello, world! How are"
    base = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    full = base[0].outputs[0]
    stop = full.text[4:7]
    assert stop.strip(), "the tiny model should produce some text"
    cut = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=20, stop=[stop]), use_tqdm=False
    )
    out = cut[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    third = full.token_ids[2]
    by_id = llm.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[third]),
        use_tqdm=False,
    )
    assert by_id[0].outputs[0].token_ids == full.token_ids[: full.token_ids.index(third) + 1]
    assert by_id[0].outputs[0].stop_reason == third


def test_logprobs_in_vllms_shape(llm):
    """vLLM scripts read `lp[token].logprob`, `.rank` and `.decoded_token`; the values stay
    floats too. Ranks follow the top ones; a sampled token outside them has its rank in
    the vocabulary, past theirs."""
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(
        temperature=1.5, seed=3, max_tokens=8, logprobs=2, prompt_logprobs=1, ignore_eos=True
    )
    (out,) = llm.generate("The sea is wide", params, use_tqdm=False)
    completion = out.outputs[0]
    chosen = []
    for token, entries in zip(completion.token_ids, completion.logprobs):
        ranked = sorted(entries.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked][:2] == [1, 2] and len(entries) in (2, 3)
        assert [lp.logprob for lp in ranked] == sorted(entries.values(), reverse=True)
        if len(entries) == 3:  # sampled outside the best two
            assert entries[token].rank > 2
        assert all(lp.decoded_token == tokenizer.decode([t]) for t, lp in entries.items())
        chosen.append(entries[token].logprob)
    assert sum(chosen) == pytest.approx(completion.cumulative_logprob)
    assert any(
        entries[token].rank != 1
        for token, entries in zip(completion.token_ids, completion.logprobs)
    )
    assert out.prompt_logprobs[0] is None
    for token, entries in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert entries[token].logprob <= 0 and min(lp.rank for lp in entries.values()) == 1
        assert entries[token].rank >= 1


def test_chat_uses_the_template(llm, tiny_llama):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama, out.prompt_token_ids, 8)
    two = llm.chat([messages, messages[1:]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(two) == 2


def test_chat_renders_openai_messages_as_the_server_does(llm):
    """Text parts, past tool calls with their results, tools, a continued final message:
    the offline chat renders them through the server's own path (they used to fail inside
    the template)."""
    params = SamplingParams(temperature=0.0, max_tokens=2)
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}],
        }
    ]
    plain = [{"role": "user", "content": "Say\nhi"}]
    by_parts, by_text = llm.chat([parts, plain], params, use_tqdm=False)
    assert by_parts.prompt_token_ids == by_text.prompt_token_ids

    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    history = [
        {"role": "user", "content": "Call f."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    (out,) = llm.chat(history, params, use_tqdm=False, tools=[tool])
    assert "# Tools" in out.prompt  # ChatML knows no tools: described in hermes' format
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>' in out.prompt

    opened = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello my"}]
    (out,) = llm.chat(opened, params, use_tqdm=False, continue_final_message=True)
    assert out.prompt.endswith("<|im_start|>assistant\nHello my")
    with pytest.raises(ValueError, match="set add_generation_prompt"):
        llm.chat(opened, params, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ValueError, match="set by their own arguments"):
        llm.chat(plain, params, chat_template_kwargs={"tokenize": True})
    assert llm.chat([], params) == []


def test_length_finish_reason_and_counts(llm):
    out = llm.generate("abc", SamplingParams(max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].finished()  # a method on a completion, as in vLLM
    assert len(out.outputs[0].token_ids) == 7


def test_one_priority_for_all_prompts_and_a_tqdm_class(llm):
    bars = []

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    params = SamplingParams(temperature=0.0, max_tokens=3)
    outs = llm.generate(["a", "b"], params, use_tqdm=Bar, priority=0)
    assert [len(out.outputs[0].token_ids) for out in outs] == [3, 3]
    assert len(bars) == 1 and bars[0].n == 2
    assert llm.get_default_sampling_params() == SamplingParams()


def test_settings_are_keywords_by_their_flag_names(tiny_llama):
    # --max-logprobs 2, as a keyword: a request asking for more is refused.
    strict = LLM(model=str(tiny_llama), kv_cache_memory="8MiB", max_logprobs=2)
    with pytest.raises(ValueError, match=r"at most 2 \(--max-logprobs\)"):
        strict.generate("Hi", SamplingParams(max_tokens=1, logprobs=3), use_tqdm=False)


def test_unknown_setting_is_refused_before_loading_anything():
    with pytest.raises(TypeError, match=r"'blok_size' \(did you mean 'block_size'\?\)"):
        LLM(model="/no/such/model", blok_size=32)
