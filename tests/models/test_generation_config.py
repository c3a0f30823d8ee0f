"""Where the sampling defaults come from, and which max_new_tokens caps every request, by
vLLM 0.32's rules (ModelConfig.get_diff_sampling_param and the servers'
override_max_tokens). Pure Python: files in a temporary folder, no model."""

from __future__ import annotations

import json

import pytest

from serve.models.generation_config import GenerationDefaults, generation_defaults


@pytest.fixture
def model_dir(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    config = {"temperature": 0.7, "max_new_tokens": 4, "do_sample": True, "eos_token_id": 2}
    (model / "generation_config.json").write_text(json.dumps(config))
    return model


@pytest.fixture
def folder(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "max_new_tokens": 8}))
    return folder


@pytest.mark.parametrize(
    ("source", "override", "expected"),
    [
        # The model's max_new_tokens: a default only.
        ("auto", None, GenerationDefaults({"temperature": 0.7, "max_tokens": 4})),
        ("vllm", None, GenerationDefaults({})),
        # A folder's replaces the model's, and caps.
        ("FOLDER", None, GenerationDefaults({"top_p": 0.5, "max_tokens": 8}, 8)),
        # The override goes over the file; its own max_new_tokens caps.
        (
            "auto",
            '{"temperature": 0.1, "max_new_tokens": 3}',
            GenerationDefaults({"temperature": 0.1, "max_tokens": 3}, 3),
        ),
        (
            "auto",
            {"top_k": 5},
            GenerationDefaults({"temperature": 0.7, "top_k": 5, "max_tokens": 4}),
        ),
        ("auto", {"max_new_tokens": None}, GenerationDefaults({"temperature": 0.7})),
        ("vllm", {"max_new_tokens": 3}, GenerationDefaults({"max_tokens": 3}, 3)),
        ("FOLDER", {"max_new_tokens": 2}, GenerationDefaults({"top_p": 0.5, "max_tokens": 2}, 2)),
    ],
)
def test_defaults_and_cap(model_dir, folder, source, override, expected):
    source = str(folder) if source == "FOLDER" else source
    assert generation_defaults(model_dir, source, override) == expected


def test_an_unreadable_model_file_is_ignored_but_a_named_folders_is_an_error(model_dir, folder):
    (model_dir / "generation_config.json").write_text("{not json")
    assert generation_defaults(model_dir) == GenerationDefaults()
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        generation_defaults(model_dir, str(folder))
