"""A model's pooling defaults read from its directory: the flags first, then a
sentence-transformers config (its Pooling mode, a Normalize module), then last + L2; and
the Matryoshka fields of its HF config. Unreadable or unsupported configs are logged and
the default stands."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from tiny_models import write_sentence_transformers_config

from serve.models.pooling_config import model_pooling

PLAIN = SimpleNamespace()  # an HF config without Matryoshka fields


@pytest.mark.parametrize(
    ("mode", "normalize", "expected"),
    [
        ("lasttoken", True, ("last", True)),
        ("mean_tokens", True, ("mean", True)),
        ("cls_token", False, ("cls", False)),
    ],
)
def test_a_sentence_transformers_config_sets_the_defaults(tmp_path, mode, normalize, expected):
    write_sentence_transformers_config(tmp_path, mode, normalize)
    pooling = model_pooling(tmp_path, PLAIN, 64)
    assert (pooling.pooling_type, pooling.normalize) == expected
    assert pooling.hidden_size == 64 and not pooling.supports_dimensions


def test_the_flags_win_and_without_a_config_it_is_last_normalised(tmp_path):
    default = model_pooling(tmp_path, PLAIN, 8)
    assert (default.pooling_type, default.normalize) == ("last", True)
    write_sentence_transformers_config(tmp_path, "mean_tokens", normalize=True)
    pooling = model_pooling(tmp_path, PLAIN, 8, pooling_type="cls", normalize=False)
    assert (pooling.pooling_type, pooling.normalize) == ("cls", False)


def test_unsupported_or_unreadable_configs_are_logged_and_the_default_stands(tmp_path, caplog):
    write_sentence_transformers_config(tmp_path, "max_tokens", normalize=False)
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append(
        {"idx": 9, "name": "9", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with caplog.at_level(logging.WARNING, logger="serve.models.pooling_config"):
        pooling = model_pooling(tmp_path, PLAIN, 8)
    assert (pooling.pooling_type, pooling.normalize) == ("last", False)
    assert "pooling_mode_max_tokens" in caplog.text and "Dense" in caplog.text
    (tmp_path / "modules.json").write_text("{not json")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="serve.models.pooling_config"):
        assert model_pooling(tmp_path, PLAIN, 8).pooling_type == "last"
    assert "Cannot read the sentence-transformers config" in caplog.text


def test_matryoshka_fields_of_the_hf_config(tmp_path):
    anything = model_pooling(tmp_path, SimpleNamespace(is_matryoshka=True), 64)
    assert anything.supports_dimensions and anything.matryoshka_dimensions is None
    listed = model_pooling(tmp_path, SimpleNamespace(matryoshka_dimensions=[32, 16]), 64)
    assert listed.supports_dimensions and listed.matryoshka_dimensions == (32, 16)
