"""SamplingParams: validated at construction, greedy normalised, stop strings collected."""

from __future__ import annotations

import pytest

from serve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
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
    ],
)
def test_invalid_value_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


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


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 1.0},
        {"top_p": 0.01},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"top_k": 1},
        {"max_tokens": 1},
        {"max_tokens": None},
        {"temperature": 0.0},
        {"seed": 0},
        {"logprobs": 0},
        {"stop_token_ids": [0, 7]},
    ],
)
def test_boundary_values_are_valid(kwargs):
    SamplingParams(**kwargs)


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0


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
