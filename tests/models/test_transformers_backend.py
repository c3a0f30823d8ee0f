"""The transformers backend (--model-impl): causal LMs serve has no class for, run by
transformers' modeling code with serve's paged attention, greedy token for token against HF
transformers under the same workload as the native families (staggered arrivals, chunks, a
prefix hit, preemption, a window crossed); the choice between the backend and serve's own
classes; and the errors for what neither can run, through `LLM(...)` and `serve`."""

from __future__ import annotations

import json

import pytest
import transformers
from model_families import BACKEND_FAMILIES, FAMILIES_BY_KEY
from models.test_families import ENGINE, _assert_matches_hf, _run_staggered, _workload
from tiny_models import hf_log_softmax, make_tiny_config, random_prompts

from serve import LLM, SamplingParams
from serve.api.cli import main
from serve.models.registry import get_arch_config, get_model_class, supported_architectures
from serve.models.transformers_backend import TransformersForCausalLM


@pytest.mark.parametrize("family", BACKEND_FAMILIES, ids=[f.key for f in BACKEND_FAMILIES])
def test_greedy_matches_hf(tiny_model_factory, family):
    model_dir = tiny_model_factory(family.key)
    llm = LLM(model=str(model_dir), model_impl="transformers", **ENGINE)
    prompts = _workload(family)
    _assert_matches_hf(model_dir, prompts, _run_staggered(llm, prompts))
    stats = llm.stats()
    assert stats.prefix_cache_hits >= 16, "the shared prefix was not found cached"
    assert stats.num_preemptions >= 1, "the cache was meant to run out"
    assert stats.num_blocks_used == 0


def test_logprobs_equal_hf_through_the_causal_lms_own_head(tiny_model_factory):
    """Cohere2 scales its logits after the LM head (greedy cannot tell; logprobs can)."""
    model_dir = tiny_model_factory("cohere2")
    prompt = random_prompts(512, 1, 30, 30, seed=5)[0]  # crosses the window of 8
    params = SamplingParams(temperature=0.0, prompt_logprobs=0, max_tokens=1)
    llm = LLM(model=str(model_dir), model_impl="transformers", kv_cache_memory="8MiB")
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    reference = hf_log_softmax(model_dir, prompt)
    for pos in range(1, len(prompt)):
        expected = reference[pos - 1][prompt[pos]].item()
        assert out.prompt_logprobs[pos][prompt[pos]] == pytest.approx(expected, abs=1e-4)


def test_auto_is_native_where_serve_has_the_architecture_else_the_backend():
    native = make_tiny_config("llama")
    assert get_arch_config(native).model_impl == "native"
    assert get_arch_config(native, "transformers").model_impl == "transformers"
    assert get_model_class(native.architectures, "transformers") is TransformersForCausalLM
    other = make_tiny_config(_backend_only_family())
    assert get_arch_config(other).model_impl == "transformers"
    assert get_model_class(other.architectures) is TransformersForCausalLM


def test_llama_through_transformers_gives_the_native_tokens(tiny_llama):
    prompts = _workload(FAMILIES_BY_KEY["llama"])
    native = _run_staggered(LLM(model=str(tiny_llama), **ENGINE), prompts)
    backend = LLM(model=str(tiny_llama), model_impl="transformers", **ENGINE)
    assert _run_staggered(backend, prompts) == native


def _backend_only_family() -> str:
    """A family serve runs only through the backend (any of them, once some turn native)."""
    return next(f.key for f in BACKEND_FAMILIES if f.architecture not in supported_architectures())


def _config_dir(tmp_path, family: str, **overrides):
    """A model directory with only its config.json: start-up stops before any weight."""
    make_tiny_config(family, **overrides).save_pretrained(tmp_path)
    return tmp_path


def _set_architecture(model_dir, architecture: str) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "architectures": [architecture]}))


@pytest.mark.parametrize(
    ("architecture", "reason"),
    [
        ("FancyNewForCausalLM", "FancyNewForCausalLM is not a model class transformers ships"),
        ("BertForMaskedLM", "BertForMaskedLM is not a causal language model"),  # encoder-only
        ("MambaForCausalLM", "MambaForCausalLM does not take custom attention functions"),
    ],
)
def test_an_architecture_neither_path_runs_is_refused_naming_what_runs(
    tmp_path, architecture, reason
):
    model_dir = _config_dir(tmp_path, "llama")
    _set_architecture(model_dir, architecture)
    with pytest.raises(ValueError) as info:
        LLM(model=str(model_dir), kv_cache_memory="8MiB")
    message = str(info.value)
    assert f"['{architecture}'] is not supported ({reason})" in message
    assert "Supported natively: " in message and "LlamaForCausalLM" in message
    assert "runs through the transformers backend" in message


def test_serve_stops_at_start_up_on_an_unsupported_architecture(tmp_path, capsys):
    model_dir = _config_dir(tmp_path, "llama")
    _set_architecture(model_dir, "BertForMaskedLM")
    with pytest.raises(SystemExit) as info:
        main(["--model", str(model_dir), "--disable-frontend-multiprocessing"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "serve: error: Model architecture ['BertForMaskedLM'] is not supported" in err
    assert "Traceback" not in err


def test_model_impl_native_refuses_what_only_the_backend_runs(tmp_path):
    model_dir = _config_dir(tmp_path, _backend_only_family())
    with pytest.raises(ValueError, match=r"not supported natively \(--model-impl native\)"):
        LLM(model=str(model_dir), model_impl="native", kv_cache_memory="8MiB")


def test_the_backend_runs_at_one_rank(tmp_path):
    model_dir = _config_dir(tmp_path, _backend_only_family())
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1.*--model-impl native"):
        LLM(model=str(model_dir), tensor_parallel_size=2, kv_cache_memory="8MiB")


@pytest.mark.parametrize(
    ("model_type", "architecture", "config", "reason"),
    [
        ("llama4_text", "Llama4ForCausalLM", {"attention_chunk_size": 8}, "chunked"),
        ("bert", "BertLMHeadModel", {"is_decoder": False}, "not causal"),
        (
            "lfm2",
            "Lfm2ForCausalLM",
            {"layer_types": ["conv", "full_attention"]},
            "without attention",
        ),
    ],
)
def test_what_paged_attention_cannot_do_is_refused_at_load(
    model_type, architecture, config, reason
):
    config = transformers.AutoConfig.for_model(
        model_type,
        architectures=[architecture],
        **{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2},
        **{"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0},
        **config,
    )
    with pytest.raises(
        ValueError, match=f"{architecture} cannot run through the transformers backend: .*{reason}"
    ):
        TransformersForCausalLM(get_arch_config(config, "transformers"))
