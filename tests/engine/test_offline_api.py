"""The offline API's shapes, as vLLM users write them."""

from __future__ import annotations

import pytest
from tiny_models import hf_greedy
from tqdm import tqdm

from serve import LLM, SamplingParams
from serve.engine.protocol import EngineDeadError
from serve.outputs import Logprob


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
    the vocabulary, past theirs. Each dict starts with the sampled (or prompt) token, then
    the others best first, as vLLM orders them (scripts take `next(iter(entries))`)."""
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
        assert next(iter(entries)) == token
        others = [lp.logprob for t, lp in entries.items() if t != token]
        assert others == sorted(others, reverse=True)
        for t, lp in entries.items():  # a piece of a split character reads in context
            alone = tokenizer.decode([t])
            assert lp.decoded_token == alone or alone.endswith("\ufffd")
        chosen.append(entries[token].logprob)
    assert sum(chosen) == pytest.approx(completion.cumulative_logprob)
    assert any(
        entries[token].rank != 1
        for token, entries in zip(completion.token_ids, completion.logprobs)
    )
    assert out.prompt_logprobs[0] is None
    for token, entries in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert entries[token].logprob <= 0 and min(lp.rank for lp in entries.values()) == 1
        assert entries[token].rank >= 1 and next(iter(entries)) == token
    # vLLM's members a script builds or copies them with
    assert Logprob(-0.5).logprob == -0.5 and Logprob(-0.5).rank is None
    base = SamplingParams(stop=["a"], logit_bias={5: 1.0}, logprobs=2)
    copy = base.clone()
    copy.stop.append("b")
    copy.logit_bias[6] = 2.0
    assert copy.logprobs == 2 and (base.stop, base.logit_bias) == (["a"], {5: 1.0})


def test_decoded_tokens_of_split_characters_join_to_the_text(llm):
    """A character split over byte tokens decodes as vLLM's `decoded_token` gives it: ""
    on its first pieces, the whole character on the piece that ends it (each piece alone
    would be a U+FFFD)."""
    prompt = "Emoji: 🎉 🚀 😀 🐍, Héllo 世界"
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0, logprobs=0)
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    ids = out.prompt_token_ids
    texts = [entries[t].decoded_token for t, entries in zip(ids[1:], out.prompt_logprobs[1:])]
    first = llm.get_tokenizer().decode(ids[:1])
    assert "" in texts and first + "".join(texts) == prompt


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


# -- vLLM scripts, ported: the arguments they pass and the shapes they read -------------


def test_engine_seed_none_and_torch_dtypes_as_vllm_takes_them(tiny_llama):
    """`LLM(seed=None)` (older vLLM's default) used to start and then fail every sampled
    request in the sampler; `dtype=torch.float32` was refused. Both run now."""
    import torch

    from serve.config import EngineConfig, InvalidSettingError

    for dtype, name in [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")]:
        assert EngineConfig.create(dtype=dtype).model.dtype == name
    assert EngineConfig.create(dtype=torch.half).model.dtype == "float16"
    with pytest.raises(InvalidSettingError, match="dtype must be one of"):
        EngineConfig.create(dtype=torch.float64)
    with pytest.raises(InvalidSettingError, match="seed must be an integer"):
        LLM(model=str(tiny_llama), seed="abc")
    llm = LLM(model=str(tiny_llama), kv_cache_memory="8MiB", seed=None, dtype=torch.float32)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate("The sea is wide", params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_request_seed_minus_one_is_no_seed(llm):
    params = SamplingParams(temperature=1.0, seed=-1, max_tokens=4, ignore_eos=True)
    assert params.seed is None
    (out,) = llm.generate("The sea is wide", params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm, tiny_llama):
    """vLLM's `SamplingParams(truncate_prompt_tokens=N)` and 0.32's
    `tokenization_kwargs={"truncate_prompt_tokens": N}`: the model sees the prompt's last N
    tokens (the output shows them); the prompt's text stays as given."""
    prompt = "The sea is wide and the night is long"
    ids = llm.get_tokenizer()(prompt).input_ids
    greedy = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
    (by_params,) = llm.generate(
        prompt, SamplingParams(truncate_prompt_tokens=3, **greedy), use_tqdm=False
    )
    (by_kwargs,) = llm.generate(
        prompt,
        SamplingParams(**greedy),
        use_tqdm=False,
        tokenization_kwargs={"truncate_prompt_tokens": 3},
    )
    for out in (by_params, by_kwargs):
        assert out.prompt == prompt and out.prompt_token_ids == ids[-3:]
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, ids[-3:], 4, ignore_eos=True)
    # -1: as much as the context holds, with room for one token to generate.
    max_len = llm.engine.max_model_len
    long_ids = (ids * (max_len // len(ids) + 2))[: max_len + 20]
    (out,) = llm.generate(
        {"prompt_token_ids": long_ids},
        SamplingParams(truncate_prompt_tokens=-1, max_tokens=1),
        use_tqdm=False,
    )
    assert out.prompt_token_ids == long_ids[-(max_len - 1) :]
    assert len(out.outputs[0].token_ids) == 1
    (chat,) = llm.chat(
        [{"role": "user", "content": prompt}],
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        tokenization_kwargs={"truncate_prompt_tokens": 5},
    )
    assert len(chat.prompt_token_ids) == 5
    for kwargs, message in [
        ({"tokenization_kwargs": {"truncate_prompt_tokens": max_len + 1}}, "more than"),
        ({"tokenization_kwargs": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
        ({"tokenization_kwargs": {"padding": "max_length"}}, "no setting for padding"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False, **kwargs)
    with pytest.raises(ValueError, match="give one"):
        llm.generate(
            prompt,
            SamplingParams(max_tokens=1, truncate_prompt_tokens=2),
            use_tqdm=False,
            tokenization_kwargs={"truncate_prompt_tokens": 3},
        )
    assert not llm.has_unfinished_requests()


def test_add_special_tokens_from_tokenization_kwargs(llm):
    tokenizer = llm.get_tokenizer()
    bare = tokenizer("The sea", add_special_tokens=False).input_ids
    (out,) = llm.generate(
        "The sea",
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        tokenization_kwargs={"add_special_tokens": False},
    )
    assert out.prompt_token_ids == bare


def test_detokenize_false_gives_token_ids_and_no_text(llm):
    greedy = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 1}
    (text,) = llm.generate("The sea is wide", SamplingParams(**greedy), use_tqdm=False)
    (ids,) = llm.generate(
        "The sea is wide", SamplingParams(detokenize=False, **greedy), use_tqdm=False
    )
    assert text.outputs[0].text and ids.outputs[0].text == ""
    assert ids.outputs[0].token_ids == text.outputs[0].token_ids
    assert all(lp.decoded_token is None for top in ids.outputs[0].logprobs for lp in top.values())


def test_special_tokens_spacing(llm, monkeypatch):
    """`spaces_between_special_tokens=False` keeps the special tokens' texts joined, as
    this byte-level tokenizer decodes them anyway; a tokenizer that spaces them (WordPiece)
    is refused rather than left spaced."""
    tokenizer = llm.get_tokenizer()
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    keep = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True, "skip_special_tokens": False}
    prompt = {"prompt_token_ids": [im_start, im_start, 65]}
    (spaced,) = llm.generate(prompt, SamplingParams(**keep), use_tqdm=False)
    (joined,) = llm.generate(
        prompt, SamplingParams(spaces_between_special_tokens=False, **keep), use_tqdm=False
    )
    assert joined.outputs[0].text == spaced.outputs[0].text
    monkeypatch.setattr(llm, "_spaces_special_tokens", True)  # as a WordPiece tokenizer's
    with pytest.raises(ValueError, match="spaces_between_special_tokens=False is not supported"):
        llm.generate(
            prompt, SamplingParams(spaces_between_special_tokens=False, **keep), use_tqdm=False
        )
    assert not llm.has_unfinished_requests()


def test_wordpiece_decoding_is_found_to_space_special_tokens():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from serve.engine.offline_inputs import spaces_between_special_tokens

    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    wordpiece.add_special_tokens({"cls_token": "[CLS]", "sep_token": "[SEP]"})
    assert spaces_between_special_tokens(wordpiece)


def test_output_kind_delta_steps_and_final_generate(llm):
    """vLLM's `output_kind`: what each `step()` hands out for a request added by hand;
    `generate` returns the finished outputs whatever it says, as vLLM's does."""
    from serve.sampling_params import RequestOutputKind

    greedy = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    (whole,) = llm.generate("The sea is wide", SamplingParams(**greedy), use_tqdm=False)
    params = SamplingParams(output_kind=RequestOutputKind.DELTA, **greedy)
    (same,) = llm.generate("The sea is wide", params, use_tqdm=False)
    assert same.outputs[0].token_ids == whole.outputs[0].token_ids
    llm.add_request("delta", whole.prompt_token_ids, params, "The sea is wide")
    pieces = []
    while llm.has_unfinished_requests():
        pieces += [out.outputs[0].token_ids for out in llm.step() if out.outputs]
    assert len(pieces) > 1 and sum(pieces, []) == whole.outputs[0].token_ids
    # Stepped by hand, outputs are what generate hands out: Logprobs, no text without
    # detokenize.
    stepped = SamplingParams(logprobs=1, detokenize=False, **greedy)
    llm.add_request("stepped", whole.prompt_token_ids, stepped, "The sea is wide")
    last = None
    while llm.has_unfinished_requests():
        last = next((out for out in llm.step() if out.request_id == "stepped"), last)
    (completion,) = last.outputs
    assert completion.text == "" and completion.token_ids == whole.outputs[0].token_ids
    assert all(
        entries[t].rank >= 1 for t, entries in zip(completion.token_ids, completion.logprobs)
    )


def test_lora_request_without_enable_lora(llm):
    """None is taken; an adapter needs enable_lora (tests/engine/test_lora.py serves them);
    anything but a LoRARequest is refused by name."""
    from serve import LoRARequest

    params = SamplingParams(max_tokens=1)
    assert len(llm.generate("Hi", params, use_tqdm=False, lora_request=None)) == 1
    with pytest.raises(ValueError, match="must be a LoRARequest"):
        llm.generate("Hi", params, use_tqdm=False, lora_request=object())
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.chat(messages, params, use_tqdm=False, lora_request=LoRARequest("a", 1, "/a"))
    assert not llm.has_unfinished_requests()


def test_chat_template_content_format(llm):
    """vLLM's chat_template_content_format, as the server takes it: "openai" hands a
    template the parts (it was refused offline), "string" their text, and "auto" the parts
    to a template that loops over them."""
    looping = (
        "{% for m in messages %}{% for part in m['content'] %}<{{ part['text'] }}>"
        "{% endfor %}{% endfor %}"
    )
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    params = SamplingParams(max_tokens=1)
    tokenizer = llm.get_tokenizer()

    def prompt(form: str, template: str | None = looping) -> str:
        (out,) = llm.chat(
            messages, params, use_tqdm=False, chat_template=template,
            chat_template_content_format=form,
        )  # fmt: skip
        return tokenizer.decode(out.prompt_token_ids)

    assert prompt("openai") == prompt("auto") == "<Hi>"
    assert prompt("string") == "<><>"  # the text: a part per character, none with a text
    assert prompt("auto", None) == prompt("string", None)  # the model's own template
    with pytest.raises(ValueError, match="chat_template_content_format is one of"):
        llm.chat(messages, params, chat_template_content_format="parts")


def test_beam_search_in_vllms_form(llm):
    """`llm.beam_search(prompts, BeamSearchParams(...))` returns vLLM's shape: per prompt
    the beam_width best `sequences`, each with the prompt's and its own `tokens`, their
    `text`, `cum_logprob` and per-token `logprobs`; the beams are serve's (HF's ranking)."""
    from serve import BeamSearchOutput, BeamSearchParams

    tokenizer = llm.get_tokenizer()
    prompts = ["The sea is wide", {"prompt_token_ids": [5, 6, 7, 8]}]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True, length_penalty=0.5)
    outs = llm.beam_search(prompts, params, use_tqdm=False)
    serves = llm.beam_search(prompts, 3, 6, length_penalty=0.5, ignore_eos=True, use_tqdm=False)
    assert len(outs) == 2 and all(isinstance(out, BeamSearchOutput) for out in outs)
    for out, serve_out in zip(outs, serves):
        assert len(out.sequences) == 3
        for seq, beam in zip(out.sequences, serve_out.outputs, strict=True):
            assert seq.tokens == serve_out.prompt_token_ids + beam.token_ids
            assert seq.text == tokenizer.decode(seq.tokens, skip_special_tokens=True)
            assert seq.cum_logprob == pytest.approx(beam.cumulative_logprob)
            chosen = [top[t].logprob for t, top in zip(beam.token_ids, seq.logprobs, strict=True)]
            assert sum(chosen) == pytest.approx(seq.cum_logprob, abs=1e-4)
            assert seq.finish_reason == "length"
    one_at_a_time = llm.beam_search(prompts, params, use_tqdm=False, concurrency_limit=1)
    assert one_at_a_time == outs
    # vLLM's spellings: `params` by name, and (lora_request, use_tqdm) positional after it.
    assert llm.beam_search(prompts, params=params) == outs
    assert llm.beam_search(prompts, params, None, False) == outs
    with pytest.raises(TypeError):
        llm.beam_search(prompts, params, max_tokens=8)  # serve's form's argument
    with pytest.raises(ValueError, match="must be a LoRARequest"):
        llm.beam_search(prompts, params, lora_request=object())
    assert not llm.has_unfinished_requests()


def test_requests_after_shutdown_are_refused_by_name(tiny_llama):
    """The weights are freed at shutdown; a generate after it said only "cannot schedule
    new futures after shutdown". A second shutdown does nothing."""
    llm = LLM(model=str(tiny_llama), num_gpu_blocks_override=64, block_size=4, swap_space=0.001)
    llm.shutdown()
    llm.shutdown()
    with pytest.raises(EngineDeadError, match="The engine was shut down"):
        llm.generate("The sea is wide", SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_shutdown_stops_the_grammar_compile_threads(tiny_llama):
    """An `LLM` kept after `shutdown()` (a notebook's variable) holds no grammar thread
    nor compiled grammar: the engine closes its grammar managers."""
    import threading

    from serve.sampling_params import StructuredOutputsParams

    before = set(threading.enumerate())
    llm = LLM(model=str(tiny_llama), kv_cache_memory="8MiB")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(json=schema)
    )
    assert llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids
    compiling = [
        t for t in threading.enumerate() if t not in before and t.name.startswith("grammar-compile")
    ]
    assert compiling  # the grammar was compiled on the manager's own thread
    llm.shutdown()
    for thread in compiling:
        thread.join(timeout=5)
    assert not any(thread.is_alive() for thread in compiling)
    assert llm.engine._grammars.built is None
