"""SamplingParams: validated at construction, greedy normalised, stop strings collected;
StructuredOutputsParams: vLLM's fields, and schemas the grammar engine would not enforce."""

from __future__ import annotations

import json
import math

import pytest

from serve.outputs import OutputKind
from serve.pooling_params import PoolingParams
from serve.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from serve.structured_outputs import unenforceable_json_schema


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),  # nan < 1e-5 is False: not greedy either
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": 2.5}, "top_k"),  # failed in the sampler's gather, step after step
        ({"top_k": True}, "top_k"),
        ({"max_tokens": 8.0}, "max_tokens"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
        ({"bad_words": ["fine", "x" * 1001]}, "bad_words"),  # tokenized in the step loop
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0, "n": 2}, "max_tokens"),  # nothing sampled: nothing to sample n of
        ({"max_tokens": 0, "best_of": 3, "use_beam_search": True, "temperature": 0}, "max_tokens"),
        ({"max_tokens": 4, "pooling": PoolingParams()}, "max_tokens"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [3, -5]}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0.5}, "temperature"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0, "stop": "x"}, "stop"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": "7"}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": True}, "seed"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens"),
        ({"stop": "x", "detokenize": False}, "stop"),  # matched in text, as vLLM refuses it
        ({"output_kind": 3}, "output_kind"),
        ({"output_kind": "streamed"}, "output_kind"),
    ],
)
def test_invalid_value_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_vllms_output_controls_are_taken_as_vllm_means_them():
    """What vLLM 0.32 scripts pass: seed -1 is no seed; the output kind in any of vLLM's
    spellings; the rest kept for the offline LLM to apply."""
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2
    kinds = [RequestOutputKind.DELTA, "delta", "DELTA", 1]  # vLLM's enum numbers it 0, 1, 2
    assert {SamplingParams(output_kind=kind).output_kind for kind in kinds} == {OutputKind.DELTA}
    assert SamplingParams(output_kind=2).output_kind is OutputKind.FINAL_ONLY
    assert SamplingParams().output_kind is OutputKind.CUMULATIVE
    params = SamplingParams(
        truncate_prompt_tokens=-1, detokenize=False, spaces_between_special_tokens=False
    )
    assert params.truncate_prompt_tokens == -1 and not params.detokenize
    assert not params.spaces_between_special_tokens


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"beam_width": 0}, "beam_width"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 0.7}, "temperature"),  # serve's search is deterministic
        ({"structured_outputs": StructuredOutputsParams(regex="a+")}, "structured_outputs"),
        ({"watermarking": True}, "watermarking"),
    ],
)
def test_beam_search_params_refuse_what_serves_search_cannot_do(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})


def test_beam_search_params_are_serves_beam_search():
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True, length_penalty=0.5)
    sampling = params.sampling_params()
    assert sampling.use_beam_search and sampling.n == sampling.best_of == 3
    assert (sampling.max_tokens, sampling.ignore_eos, sampling.length_penalty) == (8, True, 0.5)
    assert sampling.logprobs == 0  # each beam's candidates, per token


def test_allowed_token_ids_are_kept_once_each_in_order():
    assert SamplingParams(allowed_token_ids=[5, 3, 5, 3, 9] * 1000).allowed_token_ids == [5, 3, 9]


def test_defaults_are_valid():
    params = SamplingParams()
    assert params.n == 1
    assert params.temperature == 1.0
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
    assert params.max_tokens == 16
    assert params.stop_strings == ()
    assert params.stop_token_ids == []
    assert not params.is_greedy
    assert not params.ignore_eos


SMALLEST_FLOAT = math.ulp(0.0)
ABOVE_ONE = math.nextafter(1.0, 2.0)


@pytest.mark.parametrize(
    ("field", "boundary", "kept_as", "beyond", "others"),
    [
        ("n", 1, 1, 0, {}),
        ("best_of", 2, 2, 1, {"n": 2}),  # best_of >= n
        ("temperature", 0.0, 0.0, -SMALLEST_FLOAT, {}),
        ("top_p", 1.0, 1.0, ABOVE_ONE, {}),
        ("top_p", SMALLEST_FLOAT, SMALLEST_FLOAT, 0.0, {}),  # (0, 1]: 0 itself is refused
        ("top_k", -1, 0, -2, {}),  # -1 means disabled, stored as 0
        ("min_p", 0.0, 0.0, -SMALLEST_FLOAT, {}),
        ("min_p", 1.0, 1.0, ABOVE_ONE, {}),
        ("max_tokens", 0, 0, -1, {}),  # 0: the prompt alone (prefill only)
        ("min_tokens", 0, 0, -1, {}),
        ("min_tokens", 5, 5, 6, {"max_tokens": 5}),  # min_tokens <= max_tokens
        ("logprobs", 0, 0, -1, {}),
        ("prompt_logprobs", 0, 0, -1, {}),
        ("seed", 2**63 - 1, 2**63 - 1, 2**63, {}),
        ("seed", -(2**63), -(2**63), -(2**63) - 1, {}),
        ("presence_penalty", 2.0, 2.0, math.nextafter(2.0, 3.0), {}),
        ("presence_penalty", -2.0, -2.0, math.nextafter(-2.0, -3.0), {}),
        ("frequency_penalty", 2.0, 2.0, math.nextafter(2.0, 3.0), {}),
        ("frequency_penalty", -2.0, -2.0, math.nextafter(-2.0, -3.0), {}),
        ("repetition_penalty", SMALLEST_FLOAT, SMALLEST_FLOAT, 0.0, {}),
        ("logit_bias", {0: 100.0}, {0: 100.0}, {0: math.nextafter(100.0, 101.0)}, {}),
        ("logit_bias", {7: -100.0}, {7: -100.0}, {7: math.nextafter(-100.0, -101.0)}, {}),
        ("logit_bias", {"3": 1}, {3: 1.0}, {-1: 1.0}, {}),  # JSON's string keys become ids
        ("stop_token_ids", [0, 7], [0, 7], [-1, 7], {}),
        ("allowed_token_ids", [0], [0], [-1], {}),
    ],
)
def test_boundary_value_is_kept_and_one_beyond_is_refused(field, boundary, kept_as, beyond, others):
    """Other fields keep their defaults (temperature 1: sampling), so greedy's reset of
    top_p, top_k and min_p cannot hide what was kept."""
    assert getattr(SamplingParams(**others, **{field: boundary}), field) == kept_as
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**others, **{field: beyond})


@pytest.mark.parametrize(("field", "value"), [("max_tokens", None), ("top_k", 0), ("top_k", 1)])
def test_values_with_no_refused_neighbour_are_kept(field, value):
    """max_tokens None: until the context window is full; top_k 0: disabled, so 1 (the
    smallest enabled top_k) is no boundary."""
    assert getattr(SamplingParams(**{field: value}), field) == value


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_greedy_normalises_filters(temperature):
    params = SamplingParams(temperature=temperature, top_p=0.5, top_k=10, min_p=0.2)
    assert params.is_greedy
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)


def test_sampling_keeps_filters():
    params = SamplingParams(temperature=0.7, top_p=0.5, top_k=10, min_p=0.2)
    assert not params.is_greedy
    assert (params.top_p, params.top_k, params.min_p) == (0.5, 10, 0.2)


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (None, ()),
        ("x", ("x",)),
        (["a", "bc"], ("a", "bc")),
        ([], ()),
    ],
)
def test_stop_strings(stop, expected):
    assert SamplingParams(stop=stop).stop_strings == expected


def test_stop_token_ids_none_becomes_empty_list():
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


class _WordTokenizer:
    """`sea` is three tokens, ` sea` one; `bay` one token either way."""

    ids = {"sea": [85, 71, 67], " sea": [393], "bay": [70], " bay": [70]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.ids[text]


def test_bad_words_past_the_models_vocabulary_are_dropped():
    """A tokenizer may be larger than the model's vocabulary: a form of a bad word with a
    token past the logits can never be generated, and masking it indexed past them."""
    params = SamplingParams(bad_words=["sea", "bay"])
    params.update_from_tokenizer(_WordTokenizer(), vocab_size=256)
    assert params.bad_words_token_ids == [[85, 71, 67], [70]]

    tokenized_before = SamplingParams(bad_words=["sea"])
    tokenized_before.update_from_tokenizer(_WordTokenizer())  # as a vLLM script may
    assert tokenized_before.bad_words_token_ids == [[85, 71, 67], [393]]
    tokenized_before.update_from_tokenizer(_WordTokenizer(), vocab_size=256)  # the engine's
    assert tokenized_before.bad_words_token_ids == [[85, 71, 67]]

    none_left = SamplingParams(bad_words=["sea"])
    none_left.update_from_tokenizer(_WordTokenizer(), vocab_size=80)
    assert none_left.bad_words_token_ids == []  # tokenized: nothing to ban


@pytest.mark.parametrize(
    ("kwargs", "needs"),
    [
        ({}, False),
        ({"n": 3}, False),  # n samples, none dropped: nothing ranks them
        ({"n": 3, "best_of": 3}, False),
        ({"logprobs": 0}, True),  # the sampled token's logprob alone
        ({"logprobs": 5}, True),
        ({"n": 1, "best_of": 2}, True),  # ranked by cumulative logprob
        ({"n": 2, "best_of": 2, "use_beam_search": True, "temperature": 0.0}, True),
        ({"best_of": 1, "use_beam_search": True, "temperature": 0.0}, True),  # run greedy
        ({"prompt_logprobs": 3}, False),  # the prompt's, computed apart
    ],
)
def test_needs_logprobs_when_asked_or_ranked(kwargs, needs):
    assert SamplingParams(**kwargs).needs_logprobs is needs


# ---- StructuredOutputsParams: vLLM's fields ----


@pytest.mark.parametrize("option", ["disable_any_whitespace", "disable_additional_properties"])
def test_structured_outputs_take_vllms_options(option):
    """What serve's grammars always do: JSON on one line, only the properties allowed."""
    for value in (True, False):
        spec = StructuredOutputsParams(json={"type": "object"}, **{option: value})
        assert spec.kind == "json" and getattr(spec, option) is value


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"structural_tag": '{"type": "structural_tag"}'}, "structural_tag is not supported"),
        ({"regex": "a", "whitespace_pattern": r"[ ]?"}, "whitespace_pattern is not supported"),
        ({"regex": "a", "structural_tag": "{}"}, "exactly one of"),
        ({"choice": []}, "non-empty list"),
        ({}, "got none"),
    ],
)
def test_structured_outputs_refuse_what_serve_cannot_do(kwargs, words):
    """A ValueError saying why, never a TypeError for one of vLLM's keywords."""
    with pytest.raises(ValueError, match=words):
        StructuredOutputsParams(**kwargs)


def test_a_schema_xgrammar_would_not_enforce_is_refused_when_built():
    """Given as a dict or as text; nested schemas are checked (tests/worker/
    test_structured_output.py holds the evidence, keyword by keyword)."""
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
        "$defs": {"t": {"type": "array", "uniqueItems": True}},
    }
    for given in (schema, json.dumps(schema)):
        with pytest.raises(ValueError, match=r"`uniqueItems` at /\$defs/t is not supported"):
            StructuredOutputsParams(json=given)
    assert StructuredOutputsParams(json="{not json").json == "{not json"  # the compiler's


def test_schemas_pydantic_writes_are_let_through():
    from enum import Enum

    from pydantic import BaseModel, Field

    class Color(Enum):
        RED = "red"
        GREEN = "green"

    class Point(BaseModel):
        x: int = Field(ge=0, le=100)
        y: float | None = None

    class Item(BaseModel):
        name: str = Field(max_length=20)
        code: str = Field(pattern="^[A-Z]{3}$")
        tags: list[str] = Field(min_length=1, max_length=3)
        color: Color = Color.RED
        points: list[Point] = []
        extra: dict[str, int] = {}

    assert unenforceable_json_schema(Item.model_json_schema()) is None
    assert StructuredOutputsParams(json=Item.model_json_schema()).kind == "json"
