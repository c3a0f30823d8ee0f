"""LoRA adapters offline: each request runs with its own adapter, in batches that mix
adapters and the base model, and greedy output equals HF transformers' on the base model
with that adapter merged into its weights (W + alpha / r * B A).

The adapters are random PEFT folders (tiny_models.make_tiny_lora) with A and B both
nonzero, so each one changes the output (checked)."""

from __future__ import annotations

import json

import pytest
from gpu_share import TWO_RANK_DEVICE
from tiny_models import hf_beam_search, hf_greedy, make_tiny_lora, merge_tiny_lora, random_prompts

from serve import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Two adapters on different modules and ranks: one on q/v and the MLP's down projection,
# one on k, o and gate/up (shards of the fused layers each adapter leaves alone stay 0).
ADAPTERS = {
    "qv-down": {"targets": ("q_proj", "v_proj", "down_proj"), "rank": 4, "seed": 1},
    "k-o-mlp": {
        "targets": ("k_proj", "o_proj", "gate_proj", "up_proj"),
        "rank": 8,
        "seed": 2,
        "use_rslora": True,
    },
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_factory):
    """Per family: the base model, and per adapter (its LoRARequest, its merged oracle)."""
    built = {}

    def build(arch: str):
        if arch not in built:
            base = tiny_model_factory(arch)
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            loras = {}
            for i, (name, options) in enumerate(ADAPTERS.items(), start=1):
                folder = make_tiny_lora(base, root / name, **options)
                oracle = merge_tiny_lora(base, folder, root / f"{name}-merged")
                loras[name] = (LoRARequest(name, i, str(folder)), oracle)
            built[arch] = (base, loras)
        return built[arch]

    return build


def _generate(llm: LLM, prompts, loras, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def _expected(base, loras, prompts, chosen) -> list[list[int]]:
    oracles = {None: base} | {request: oracle for request, oracle in loras.values()}
    return [
        hf_greedy(oracles[lora], prompt, MAX_TOKENS, ignore_eos=True)
        for prompt, lora in zip(prompts, chosen)
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_mixed_batch_matches_each_merged_model(adapters, arch):
    """Base and two adapters in the same steps (Qwen2: q/k/v biases beside the adapter;
    Phi-3: q/k/v and gate/up fused in the checkpoint, which the adapter's modules reach)."""
    base, loras = adapters(arch)
    one, two = (request for request, _ in loras.values())
    prompts = random_prompts(512, 6, 4, 20, seed=7)
    chosen = [None, one, two, one, two, None]
    llm = LLM(str(base), enable_lora=True, max_loras=2, kv_cache_memory="16MiB")
    got = _generate(llm, prompts, chosen)
    assert got == _expected(base, loras, prompts, chosen)
    # Each adapter changes what the model says.
    assert got[1] != hf_greedy(base, prompts[1], MAX_TOKENS, ignore_eos=True)
    assert got[2] != hf_greedy(base, prompts[2], MAX_TOKENS, ignore_eos=True)


def test_more_adapters_than_slots_take_turns(adapters):
    """max_loras=1: requests of the two adapters never share a step, yet all finish, each
    with its own adapter's output (the slot is rewritten as the adapters alternate), and
    base requests run beside either; chunked prompts and preemption on the way."""
    base, loras = adapters("llama")
    one, two = (request for request, _ in loras.values())
    prompts = random_prompts(512, 8, 4, 30, seed=11)
    chosen = [one, two, None, two, one, None, two, one]
    llm = LLM(
        str(base),
        enable_lora=True,
        max_loras=1,
        block_size=4,
        num_gpu_blocks_override=24,  # 96 tokens for 8 requests: preemption
        max_num_batched_tokens=16,  # longer prompts take several steps
        max_model_len=64,
    )
    seen: list[set[int]] = []
    step = llm.engine.scheduler.schedule

    def schedule():
        out = step()
        running = llm.engine.scheduler.running
        seen.append({g.lora.lora_int_id for g in running if g.lora is not None})
        return out

    llm.engine.scheduler.schedule = schedule
    assert _generate(llm, prompts, chosen) == _expected(base, loras, prompts, chosen)
    assert max(len(ids) for ids in seen) == 1
    assert {1, 2} <= set().union(*seen)


def test_prefix_cache_is_per_adapter(adapters):
    """The same prompt under the base model and each adapter: nothing computed under one
    is reused under another (each matches its own oracle), while the same adapter again
    takes its cached prefix."""
    base, loras = adapters("llama")
    one, two = (request for request, _ in loras.values())
    prompt = random_prompts(512, 1, 24, 24, seed=5)[0]
    llm = LLM(str(base), enable_lora=True, max_loras=2, block_size=4, kv_cache_memory="4MiB")
    for lora in (None, one, two):
        (got,) = _generate(llm, [prompt], [lora])
        assert [got] == _expected(base, loras, [prompt], [lora])
    again = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=one)
    assert again[0].num_cached_tokens == 20  # 5 full blocks of 4 (never the last token)
    assert list(again[0].outputs[0].token_ids) == _expected(base, loras, [prompt], [one])[0]


def test_beam_search_and_samples_keep_the_adapter(adapters):
    """Forked sequences (beams, n samples) run with their request's adapter."""
    base, loras = adapters("llama")
    one, oracle = loras["qv-down"]
    prompt = random_prompts(512, 1, 8, 8, seed=9)[0]
    llm = LLM(str(base), enable_lora=True, kv_cache_memory="16MiB")
    beams = SamplingParams(
        n=3, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=6, ignore_eos=True
    )
    out = llm.generate([{"prompt_token_ids": prompt}], beams, use_tqdm=False, lora_request=one)
    got = [list(c.token_ids) for c in out[0].outputs]
    assert got == [tokens for tokens, _ in hf_beam_search(oracle, prompt, 3, 6)]
    # n=2 greedy samples: both are the oracle's greedy continuation.
    two = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], two, use_tqdm=False, lora_request=one)
    expected = hf_greedy(oracle, prompt, MAX_TOKENS, ignore_eos=True)
    assert [list(c.token_ids) for c in out[0].outputs] == [expected, expected]


def test_tensor_parallel_slices_the_adapter(adapters):
    """Two ranks: the column-parallel layers hold their rows of B, the row-parallel ones
    their columns of A; the partial updates are reduced with the layer's own."""
    base, loras = adapters("llama")
    one, two = (request for request, _ in loras.values())
    prompts = random_prompts(512, 3, 4, 16, seed=13)
    chosen = [one, None, two]
    llm = LLM(
        str(base),
        enable_lora=True,
        max_loras=2,
        tensor_parallel_size=2,
        device=TWO_RANK_DEVICE,
        kv_cache_memory="16MiB",
    )
    try:
        assert _generate(llm, prompts, chosen) == _expected(base, loras, prompts, chosen)
    finally:
        llm.shutdown()


def _folder(tmp_path, base, name, **options):
    return str(make_tiny_lora(base, tmp_path / name, **options))


def test_bad_adapters_are_refused_before_running(adapters, tmp_path, tiny_model_factory):
    base, loras = adapters("llama")
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, kv_cache_memory="4MiB")
    prompt = [{"prompt_token_ids": [5, 6, 7]}]

    def refused(lora: LoRARequest, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)

    refused(
        LoRARequest("big", 10, _folder(tmp_path, base, "big", rank=16)), "above max_lora_rank 8"
    )
    refused(LoRARequest("none", 11, str(tmp_path / "missing")), "no such folder")
    dora = _folder(tmp_path, base, "dora", use_dora=True)
    refused(LoRARequest("dora", 12, dora), "DoRA")
    head = _folder(tmp_path, base, "head", targets=("lm_head",))
    refused(LoRARequest("head", 13, head), "lm_head, which is not one of this model's")
    # An adapter trained for another model's shapes (hidden 64 against 96).
    other = tiny_model_factory("llama", hidden_size=96, head_dim=24)
    refused(LoRARequest("other", 14, _folder(tmp_path, other, "other")), "do not fit a layer")
    # One id, two adapters: the prefix cache keys K/V by the id.
    first, _ = loras["qv-down"]
    llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=first)
    second = loras["k-o-mlp"][0].lora_path
    refused(LoRARequest("again", first.lora_int_id, second), "give each adapter an id")
    # The engine runs on: the good adapter still serves.
    out = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=first)
    assert len(out[0].outputs[0].token_ids) == MAX_TOKENS


def test_lora_request_needs_enable_lora(adapters):
    base, loras = adapters("llama")
    llm = LLM(str(base), kv_cache_memory="4MiB")
    lora, _ = loras["qv-down"]
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=lora)


def test_adapter_config_errors_name_the_problem(adapters, tmp_path):
    base, _ = adapters("llama")
    llm = LLM(str(base), enable_lora=True, kv_cache_memory="4MiB")
    folder = tmp_path / "bias"
    make_tiny_lora(base, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "bias": "all"}))
    with pytest.raises(ValueError, match="bias 'all' is not supported"):
        llm.generate(
            [[5, 6]], GREEDY, use_tqdm=False, lora_request=LoRARequest("b", 3, str(folder))
        )


@pytest.mark.parametrize(
    ("arch", "targets"),
    [
        ("gpt-neox", ("query_key_value", "dense_4h_to_h")),  # q/k/v interleaved per head
        ("gpt2", ("c_attn", "c_fc")),  # Conv1D weights stored [in, out]; A and B are not
        ("mixtral", ("q_proj", "v_proj", "o_proj")),  # attention of a mixture of experts
        ("gemma2", ("q_proj", "down_proj")),
        # multi-head latent attention's projections (kv_b_proj has none: below)
        ("deepseek-v3", ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")),
    ],
)
def test_other_layouts_match_the_merged_model(tiny_model_factory, tmp_path, arch, targets):
    base = tiny_model_factory(arch)
    folder = make_tiny_lora(base, tmp_path / "adapter", targets=targets, seed=3)
    oracle = merge_tiny_lora(base, folder, tmp_path / "merged")
    prompts = random_prompts(512, 2, 5, 12, seed=4)
    lora = LoRARequest("a", 1, str(folder))
    llm = LLM(str(base), enable_lora=True, kv_cache_memory="16MiB")
    got = _generate(llm, prompts, [lora, None])
    assert got[0] == hf_greedy(oracle, prompts[0], MAX_TOKENS, ignore_eos=True)
    assert got[1] == hf_greedy(base, prompts[1], MAX_TOKENS, ignore_eos=True)
    assert got[0] != hf_greedy(base, prompts[0], MAX_TOKENS, ignore_eos=True)


def test_stats_count_the_requests_of_each_adapter(adapters):
    """What /metrics' lora_requests_info reads: requests per adapter name, running and
    waiting (max_loras 1: the second adapter's request waits for the first's)."""
    base, loras = adapters("llama")
    one, two = (request for request, _ in loras.values())
    llm = LLM(str(base), enable_lora=True, max_loras=1, kv_cache_memory="4MiB")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, lora in enumerate([one, one, two, None]):
        llm.add_request(f"r{i}", [5, 6, 7, 8], params, lora_request=lora)
    stats = llm.engine.stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == (
        {},
        {"qv-down": 2, "k-o-mlp": 1},
    )
    llm.step()
    stats = llm.engine.stats()
    assert stats.running_lora_adapters == {"qv-down": 2}
    assert stats.waiting_lora_adapters == {"k-o-mlp": 1}
    while llm.has_unfinished_requests():
        llm.step()
    stats = llm.engine.stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == ({}, {})


def test_an_adapter_that_cannot_be_read_again_fails_its_requests_alone(adapters, tmp_path):
    """An adapter pushed out of host memory is read again from its folder when next used;
    if the folder has gone meanwhile, its requests fail with the reason and every other
    request, in the same step and after, runs on."""
    import shutil

    from serve import RequestsFailedError

    base, loras = adapters("llama")
    one, _ = loras["qv-down"]
    folder = shutil.copytree(one.lora_path, tmp_path / "gone")
    gone = LoRARequest("gone", 7, str(folder))
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_cpu_loras=1, kv_cache_memory="4MiB")
    prompts = random_prompts(512, 2, 6, 10, seed=21)
    _generate(llm, prompts[:1], [gone])
    _generate(llm, prompts[:1], [one])  # pushes "gone" out of the slot and host memory
    shutil.rmtree(folder)
    with pytest.raises(RequestsFailedError) as failed:
        _generate(llm, prompts, [gone, None])
    lost, kept = failed.value.outputs
    assert "could not be read again" in lost.error and "no such folder" in lost.error
    assert kept.error is None
    assert list(kept.outputs[0].token_ids) == hf_greedy(
        base, prompts[1], MAX_TOKENS, ignore_eos=True
    )
    assert _generate(llm, prompts, [one, None]) == _expected(base, loras, prompts, [one, None])


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_checks_proposals_with_the_adapter(adapters, method):
    """Proposals (n-gram lookup, or the base model as its own draft, which knows no
    adapter) are checked by the target's forward with each request's adapter: greedy
    output is the merged model's whatever was proposed."""
    base, loras = adapters("llama")
    one, two = (request for request, _ in loras.values())
    spec = {"method": method, "num_speculative_tokens": 3}
    spec |= {"prompt_lookup_max": 3, "prompt_lookup_min": 1} if method == "ngram" else {}
    spec |= {"model": str(base)} if method == "draft_model" else {}
    # Repetitive prompts, so that n-gram lookup finds proposals.
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [12, 13] * 6]
    chosen = [one, None, two]
    llm = LLM(
        str(base),
        enable_lora=True,
        max_loras=2,
        kv_cache_memory="16MiB",
        speculative_config=json.dumps(spec),
    )
    assert _generate(llm, prompts, chosen) == _expected(base, loras, prompts, chosen)
    assert llm.stats().spec_decode.num_draft_tokens > 0


def test_an_adapter_on_deepseeks_absorbed_projection_is_refused(tiny_model_factory, tmp_path):
    """kv_b_proj is folded into DeepSeek's query and output at load, never run as a layer:
    an adapter on it would be silently ignored, so it is refused, naming the module."""
    base = tiny_model_factory("deepseek-v3")
    llm = LLM(str(base), enable_lora=True, kv_cache_memory="4MiB")
    lora = LoRARequest("kv", 1, _folder(tmp_path, base, "kv", targets=("kv_b_proj",)))
    with pytest.raises(ValueError, match="kv_b_proj, which is not one of this model's"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=lora)
