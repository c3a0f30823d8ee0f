"""What loading a model directory may never do: unpickle weights nobody allowed, or run
code the checkpoint ships (`auto_map` and `trust_remote_code`)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from serve.config import ModelConfig
from serve.models.loader import iterate_weights, load_hf_config
from serve.models.tokenizer import eos_token_ids, load_tokenizer

# -- pickled weights -------------------------------------------------------------------


def save_as_pickle(model_dir: Path, out_dir: Path, keep_safetensors: bool = False) -> Path:
    """A copy of `model_dir` with its weights in `pytorch_model.bin`, as transformers 4
    wrote them with `safe_serialization=False` (transformers 5 writes only safetensors)."""
    shutil.copytree(model_dir, out_dir)
    weights = {}
    for file in sorted(out_dir.glob("*.safetensors")):
        weights.update(load_file(file))
        if not keep_safetensors:
            file.unlink()
    torch.save(weights, out_dir / "pytorch_model.bin")
    return out_dir


@pytest.fixture(scope="module")
def pickled_llama(tiny_llama, tmp_path_factory) -> Path:
    return save_as_pickle(tiny_llama, tmp_path_factory.mktemp("pickled") / "tiny-llama")


def weights(path: Path, load_format: str = "auto", allow_pickle: bool = False):
    return dict(iterate_weights(path, load_format, allow_pickle=allow_pickle))


def test_pickled_weights_are_refused_without_the_flag(pickled_llama):
    for load_format in ("auto", "pt"):
        with pytest.raises(ValueError, match="--allow-pickle-weights"):
            weights(pickled_llama, load_format)
    with pytest.raises(FileNotFoundError, match=r"\*\.safetensors"):
        weights(pickled_llama, "safetensors", allow_pickle=True)


def test_pt_load_format_needs_the_flag():
    with pytest.raises(ValueError, match="--allow-pickle-weights"):
        ModelConfig(load_format="pt")
    assert ModelConfig(load_format="pt", allow_pickle_weights=True).allow_pickle_weights
    assert not ModelConfig().allow_pickle_weights


def test_pickled_weights_load_with_the_flag(tiny_llama, pickled_llama):
    expected = weights(tiny_llama)
    for load_format in ("auto", "pt"):
        loaded = weights(pickled_llama, load_format, allow_pickle=True)
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[name], expected[name]) for name in expected)


def test_safetensors_win_over_pickles_and_need_no_flag(tiny_llama, tmp_path):
    both = save_as_pickle(tiny_llama, tmp_path / "both", keep_safetensors=True)
    (both / "pytorch_model.bin").write_bytes(b"not a pickle: must never be read")
    assert weights(both).keys() == weights(tiny_llama).keys()
    with pytest.raises(Exception, match="(?i)pickle|zip|magic"):  # "pt" reads the .bin
        weights(both, "pt", allow_pickle=True)


class _RunsCode:
    """Unpickles into a call of os.system: what a hostile checkpoint ships."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_hostile_pickle_never_runs(tiny_llama, tmp_path):
    model_dir = tmp_path / "hostile-pickle"
    shutil.copytree(tiny_llama, model_dir)
    for file in model_dir.glob("*.safetensors"):
        file.unlink()
    marker = tmp_path / "pickle-ran"
    payload = {"model.embed_tokens.weight": _RunsCode(f"touch {marker}")}
    (model_dir / "pytorch_model.bin").write_bytes(pickle.dumps(payload, protocol=2))

    with pytest.raises(ValueError, match="--allow-pickle-weights"):
        weights(model_dir)  # refused before the file is opened
    # Allowed, the file is still read by torch's restricted unpickler, which refuses it.
    with pytest.raises(pickle.UnpicklingError):
        weights(model_dir, allow_pickle=True)
    assert not marker.exists()


# -- trust_remote_code -----------------------------------------------------------------

HOSTILE_MODULE = """\
from pathlib import Path

Path({marker!r}).touch()  # runs on import: the test looks for this file

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


class HostileConfig(LlamaConfig):
    pass


class HostileModel(LlamaForCausalLM):
    pass


class HostileTokenizer(PreTrainedTokenizerFast):
    pass
"""


def make_hostile_model(tiny_llama: Path, out_dir: Path, marker: Path) -> Path:
    """The tiny llama, plus `hostile.py` that creates `marker` when imported, named in
    every `auto_map` transformers reads: the config's and the tokenizer's."""
    shutil.copytree(tiny_llama, out_dir)
    (out_dir / "hostile.py").write_text(HOSTILE_MODULE.format(marker=str(marker)))
    tokenizer_class = ["hostile.HostileTokenizer", "hostile.HostileTokenizer"]
    config = json.loads((out_dir / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "hostile.HostileConfig",
        "AutoModelForCausalLM": "hostile.HostileModel",
        "AutoTokenizer": tokenizer_class,
    }
    (out_dir / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": tokenizer_class}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return out_dir


def test_the_hostile_model_would_run_code_if_trusted(tiny_llama, tmp_path):
    """The control: transformers does import `hostile.py` when trust_remote_code=True, so
    the tests below would see the marker if serve trusted remote code anywhere."""
    marker = tmp_path / "remote-code-ran"
    model_dir = make_hostile_model(tiny_llama, tmp_path / "hostile", marker)
    trusting = (
        "import sys\n"
        "from transformers import AutoConfig\n"
        "AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    cmd = [sys.executable, "-c", trusting, str(model_dir)]
    subprocess.run(cmd, env=env, capture_output=True, timeout=120, check=False)
    assert marker.exists()


def test_loading_never_runs_a_checkpoints_code(tiny_llama, tmp_path):
    from serve import LLM, SamplingParams

    marker = tmp_path / "remote-code-ran"
    model_dir = make_hostile_model(tiny_llama, tmp_path / "hostile", marker)

    hf_config = load_hf_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    eos_token_ids(model_dir, hf_config, tokenizer)
    assert type(hf_config).__name__ == "LlamaConfig"
    assert not marker.exists()

    llm = LLM(model=str(model_dir), kv_cache_memory="8MiB")
    assert len(llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)) == 1
    assert not marker.exists()


# -- broken weight files -----------------------------------------------------------------

LFS_POINTER = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 1\n"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: LFS_POINTER, "is a git-lfs pointer, not the weights"),
        (lambda data: os.urandom(4096), "is not a safetensors file"),
        (lambda data: data[: len(data) // 2], "is cut short"),
        (lambda data: data[:8] + b"#" + data[9:], "no readable safetensors header"),
    ],
)
def test_a_broken_weights_file_is_named_with_what_is_wrong(tiny_llama, tmp_path, damage, message):
    from serve.models.loader import weights_bytes

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (file,) = broken.glob("*.safetensors")
    file.write_bytes(damage(file.read_bytes()))
    for read in (lambda: weights_bytes(broken, "auto", torch.float32), lambda: weights(broken)):
        with pytest.raises(ValueError, match=message) as info:
            read()
        assert str(file) in str(info.value)


def test_gguf_load_format_without_a_gguf_file_is_refused(tiny_llama):
    from serve.models.loader import resolve_model_path

    with pytest.raises(FileNotFoundError, match=r"No weights \(\*\.gguf\)"):
        resolve_model_path(str(tiny_llama), "gguf")


def test_a_tokenizer_is_never_downloaded_and_a_missing_one_is_named(tmp_path):
    with pytest.raises(ValueError, match="serve does not download"):
        load_tokenizer("no-such-org/no-such-tokenizer")  # not in the HF cache: no network
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        load_tokenizer(tmp_path)


def test_a_checkpoint_quantized_by_a_method_serve_does_not_read_is_refused_by_it(
    tiny_llama, tmp_path
):
    """Its tensors (weight_scale, qweight) used to be refused one name at a time, after the
    log had called the checkpoint float32."""
    quantized = tmp_path / "bnb"
    shutil.copytree(tiny_llama, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantized checkpoint \(bitsandbytes\); serve reads"):
        load_hf_config(quantized)


def test_a_processors_chat_template_is_the_tokenizers_when_it_has_none(tiny_llava, tmp_path):
    """llava-hf's checkpoints keep the template in chat_template.json (the processor's),
    which transformers' tokenizer does not read: serve's tokenizer takes it, while a
    template of the tokenizer's own wins."""
    import json
    import shutil

    model_dir = tmp_path / "llava"
    shutil.copytree(tiny_llava, model_dir)
    for file in model_dir.glob("chat_template.*"):
        file.unlink()
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(model_dir).chat_template is None
    template = "{% for m in messages %}USER: {{ m['content'] }}\n{% endfor %}ASSISTANT:"
    (model_dir / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.chat_template == template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert prompt == "USER: hi\nASSISTANT:"
    assert load_tokenizer(tiny_llava).chat_template != template  # its own template kept
