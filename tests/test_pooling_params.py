"""PoolingParams and a model's pooling: the values refused, what `dimensions` a model
allows (vLLM's Matryoshka rule), and the model's defaults filled into a request."""

from __future__ import annotations

import pytest

from serve.pooling_params import ModelPooling, PoolingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"pooling_type": "max"}, "pooling_type"),
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": -3}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
        ({"dimensions": 2.5}, "dimensions"),
    ],
)
def test_invalid_value_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        PoolingParams(**kwargs)


def test_dimensions_need_a_matryoshka_model():
    plain = ModelPooling("last", True, hidden_size=64)
    plain.check(PoolingParams())
    with pytest.raises(ValueError, match=r"^dimensions is not supported by this model"):
        plain.check(PoolingParams(dimensions=16))

    any_size = ModelPooling("last", True, hidden_size=64, is_matryoshka=True)
    any_size.check(PoolingParams(dimensions=16))
    any_size.check(PoolingParams(dimensions=64))
    with pytest.raises(ValueError, match=r"^dimensions is 65, more than .* \(64\)"):
        any_size.check(PoolingParams(dimensions=65))

    listed = ModelPooling("last", True, hidden_size=64, matryoshka_dimensions=(16, 32))
    listed.check(PoolingParams(dimensions=32))
    with pytest.raises(ValueError, match=r"^dimensions must be one of .*16, 32.*got 24"):
        listed.check(PoolingParams(dimensions=24))


def test_resolve_fills_only_what_the_request_left_out():
    model = ModelPooling("mean", False, hidden_size=64, is_matryoshka=True)
    assert model.resolve(PoolingParams()) == PoolingParams("mean", False, None)
    asked = PoolingParams("cls", True, 8)
    assert model.resolve(asked) == asked
    assert not PoolingParams("last").needs_every_position
    assert PoolingParams("mean").needs_every_position and PoolingParams().needs_every_position
