"""Bad input fails at once with a message that says what to change."""

from __future__ import annotations

import pytest

from serve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), max_model_len=64, kv_cache_memory="8MiB")


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)


def test_prompt_over_max_model_len(llm):
    with pytest.raises(ValueError, match=r"70 tokens.*max_model_len\) is 64"):
        llm.generate({"prompt_token_ids": [5] * 70}, use_tqdm=False)


def test_out_of_vocab_token_ids(llm):
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        llm.generate({"prompt_token_ids": [3, 512, -1]}, use_tqdm=False)


def test_a_bad_prompt_in_a_batch_leaves_nothing_behind(llm):
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": []}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"max_tokens": -1}, "max_tokens"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_list_must_match_prompts(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["hi"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(model=str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError, match="not in the local HF cache"):
        LLM(model="no-such-org/no-such-model")


def test_pickle_weights_need_explicit_opt_in(tiny_llama, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file

    model_dir = tmp_path / "bin-model"
    shutil.copytree(tiny_llama, model_dir)
    for file in model_dir.glob("*.safetensors"):
        torch.save(load_file(file), model_dir / "pytorch_model.bin")
        file.unlink()
    with pytest.raises(ValueError, match="--allow-pickle-weights"):
        LLM(model=str(model_dir), kv_cache_memory="8MiB")
    with pytest.raises(ValueError, match="--allow-pickle-weights"):
        LLM(model=str(model_dir), load_format="pt", kv_cache_memory="8MiB")
    for load_format in ("auto", "pt"):
        llm = LLM(
            model=str(model_dir),
            load_format=load_format,
            allow_pickle_weights=True,
            kv_cache_memory="8MiB",
        )
        assert len(llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)) == 1


def test_unsupported_architecture(tiny_llama, tmp_path):
    import json
    import shutil

    model_dir = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*not supported.*LlamaForCausalLM"):
        LLM(model=str(model_dir), kv_cache_memory="8MiB")
