"""Engine settings as `LLM(...)` / `EngineConfig.create(...)` users meet them: every field of
every config class is a keyword by its own name, bad values are refused naming the
setting, and sizes read as the flags document them. Pure Python: no torch, no model."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
from setting_examples import EXAMPLES, config_fields

from serve import config as serve_config
from serve.config import (
    EngineConfig,
    GiB,
    InvalidSettingError,
    engine_settings,
    fit_max_num_batched_tokens,
)


def test_every_config_field_has_an_example():
    names = {name for _, name, _ in config_fields()}
    assert names == set(EXAMPLES), "add a line to tests/setting_examples.py for a new setting"


@pytest.mark.parametrize(("section", "name", "default"), config_fields())
def test_every_config_field_is_a_keyword_by_its_own_name(section, name, default):
    value = EXAMPLES[name].value
    assert value != default
    config = EngineConfig.create(**{name: value})
    owner = getattr(config, section) if section else config
    assert getattr(owner, name) == value
    # ... and that keyword moved nothing else.
    assert EngineConfig.create(**{name: default}) == EngineConfig()


def test_no_keyword_is_left_at_its_default_when_given():
    everything = EngineConfig.create(**{name: ex.value for name, ex in EXAMPLES.items()})
    for section, name, _ in config_fields():
        owner = getattr(everything, section) if section else everything
        assert getattr(owner, name) == EXAMPLES[name].value, name


def test_settings_are_the_config_fields_in_order():
    assert [s.name for s in engine_settings()] == [name for _, name, _ in config_fields()]


def test_unknown_keyword_is_named_with_a_suggestion_and_the_valid_ones():
    with pytest.raises(TypeError) as info:
        EngineConfig.create("m", kv_cache_memroy="4GiB")
    message = str(info.value)
    assert "'kv_cache_memroy' (did you mean 'kv_cache_memory'?)" in message
    assert all(s.name in message for s in engine_settings())
    # Server flags are not engine settings.
    with pytest.raises(TypeError, match="Unknown engine setting 'port'"):
        EngineConfig.create(port=8000)


def test_vllms_engine_arguments_are_taken_as_vllm_means_them():
    assert EngineConfig.create("m", enforce_eager=True).cuda_graphs is False
    assert EngineConfig.create("m", trust_remote_code=True) == EngineConfig.create("m")
    quiet = EngineConfig.create("m", disable_log_stats=True)
    assert quiet == EngineConfig.create("m", log_stats=False)
    assert EngineConfig.create("m", pipeline_parallel_size=1) == EngineConfig.create("m")
    assert EngineConfig.create("m", dtype="half") == EngineConfig.create("m", dtype="float16")
    assert EngineConfig.create("m", dtype="float") == EngineConfig.create("m", dtype="float32")
    for config in (
        {"backend": "xgrammar"},
        '{"backend": "auto"}',
        {"backend": "xgrammar", "disable_any_whitespace": True},  # what serve does anyway
    ):
        assert EngineConfig.create("m", structured_outputs_config=config) == (
            EngineConfig.create("m")
        )
    assert EngineConfig.create("m", tokenizer_mode="auto", revision=None, quantization=None) == (
        EngineConfig.create("m")
    )
    for kwargs, refused in [
        (
            {"quantization": "bitsandbytes"},
            "quantization must be one of gptq, awq, fp8, compressed-tensors, gptq_marlin, awq_marlin",
        ),
        ({"revision": "main"}, "revision cannot be chosen"),
        ({"tokenizer_mode": "mistral"}, "tokenizer_mode must be auto"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size must be 1"),
        ({"structured_outputs_config": {"backend": "guidance"}}, "must be xgrammar or auto"),
        ({"structured_outputs_config": '{"backend": "outlines"}'}, "must be xgrammar or auto"),
        ({"structured_outputs_config": "xgrammar"}, "must be a JSON object"),
        ({"structured_outputs_config": {"reasoning_parser": "x"}}, "no setting for"),
        ({"structured_outputs_config": {"disable_any_whitespace": False}}, "no setting for"),
    ]:
        with pytest.raises(InvalidSettingError, match=refused):
            EngineConfig.create("m", **kwargs)


def test_vllms_other_engine_arguments_are_taken_or_refused_by_name():
    """Arguments of vLLM scripts (0.32's and older ones') that change nothing serve does
    are taken; those whose meaning serve cannot give are refused, naming the argument."""
    same = [
        {"runner": "pooling"},
        {"runner": "generate", "convert": "embed"},
        {"task": "embed"},
        {"task": "generate"},
        {"cpu_offload_gb": 0},
        {"cpu_offload_gb": "0"},  # as the flag gives it
        {"max_seq_len_to_capture": 8192},
        {"disable_custom_all_reduce": True},
        {"compilation_config": 3},
        {"compilation_config": '{"level": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}'},
        {"hf_overrides": {}},
        {"download_dir": None},
    ]
    for kwargs in same:
        assert EngineConfig.create("m", **kwargs) == EngineConfig.create("m"), kwargs
    eager = EngineConfig.create("m", compilation_config={"cudagraph_mode": "NONE"})
    assert eager == EngineConfig.create("m", cuda_graphs=False)
    for kwargs, refused in [
        ({"runner": "draft"}, "runner must be auto, generate or pooling"),
        ({"convert": "classify"}, "convert must be auto, none or embed"),
        ({"task": "classify"}, "task must be auto, generate or embed"),
        ({"cpu_offload_gb": 4}, "cpu_offload_gb must be 0"),
        ({"max_seq_len_to_capture": 0}, "max_seq_len_to_capture must be a positive integer"),
        ({"compilation_config": {"splitting_ops": []}}, "no setting for splitting_ops"),
        ({"compilation_config": {"level": 7}}, "level must be 0-3"),
        ({"hf_overrides": {"rope_scaling": {}}}, "hf_overrides is not supported"),
        ({"download_dir": "/data/models"}, "download_dir cannot be set: serve never downloads"),
    ]:
        with pytest.raises(InvalidSettingError, match=refused):
            EngineConfig.create("m", **kwargs)


def test_seed_is_an_integer_and_none_draws_one(caplog):
    """vLLM's LLM(seed=None) (older vLLM's default) used to reach the sampler and fail
    every sampled request; now it means no fixed seed: one drawn at random, logged."""
    with caplog.at_level("INFO", logger="serve.config"):
        seeds = {EngineConfig.create(seed=None).model.seed for _ in range(3)}
    assert all(type(seed) is int for seed in seeds) and len(seeds) > 1
    assert "seed=None" in caplog.text
    for seed in ("abc", 1.5, True, 2**64):
        with pytest.raises(InvalidSettingError, match=r"^seed must be an integer"):
            EngineConfig.create(seed=seed)


@pytest.mark.parametrize(
    ("value", "tokens"),
    [(2048, 2048), ("2048", 2048), ("4k", 4000), ("25.6k", 25600), ("4K", 4096), ("1M", 1 << 20)]
    + [(-1, None), ("-1", None), ("auto", None), (None, None)],
)
def test_max_model_len_reads_as_vllm_writes_it(value, tokens):
    assert EngineConfig.create(max_model_len=value).model.max_model_len == tokens


def test_sizes_read_as_the_flags_say():
    cache = EngineConfig.create(kv_cache_memory="512MiB", swap_space=2.5).cache
    assert cache.kv_cache_memory == "512MiB" and cache.kv_cache_memory_bytes == 512 << 20
    assert cache.swap_space_bytes == int(2.5 * GiB)  # swap_space is GiB, as in vLLM
    assert EngineConfig.create(kv_cache_memory=1 << 20).cache.kv_cache_memory_bytes == 1 << 20
    default = EngineConfig().cache
    assert default.kv_cache_memory_bytes is None and default.swap_space_bytes == 4 * GiB


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 24}, "block_size must be a power of two up to 256, got 24."),
        ({"block_size": 512}, "block_size must be a power of two up to 256, got 512."),
        ({"device": "foo"}, "device must be auto, cpu, cuda or cuda:N; got 'foo'."),
        ({"device": "mps"}, "device must be auto, cpu, cuda or cuda:N; got 'mps'."),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory must be a positive size like 4GiB"),
        ({"kv_cache_memory": "0GiB"}, "kv_cache_memory must be a positive size like 4GiB"),
        ({"swap_space": -1}, "swap_space must be >= 0, got -1."),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1]"),
        (
            {"dtype": "fp8"},
            "dtype must be one of auto, float32, float16, bfloat16, half, float; got 'fp8'.",
        ),
        ({"preemption_mode": "drop"}, "preemption_mode must be one of recompute, swap"),
        ({"load_format": "pt"}, "load_format 'pt' loads pickled weights"),
        ({"max_num_seqs": 0}, "max_num_seqs must be positive, got 0."),
        ({"max_model_len": 0}, "max_model_len must be positive, got 0."),
        ({"max_model_len": "lots"}, "max_model_len must be a number of tokens like 4096"),
        ({"max_model_len": "1.5K"}, "max_model_len binary suffixes take whole numbers"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be positive, got 0."),
        ({"response_store_max_entries": 0}, "response_store_max_entries must be positive"),
        ({"response_store_ttl_s": 0}, "response_store_ttl_s must be a positive number"),
        (
            {"distributed_executor_backend": "slurm"},
            "distributed_executor_backend must be one of uniproc, mp, ray; got 'slurm'.",
        ),
        (
            {"distributed_executor_backend": "uniproc", "tensor_parallel_size": 2},
            "distributed_executor_backend 'uniproc' runs one rank",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_setting(kwargs, message):
    with pytest.raises(InvalidSettingError) as info:
        EngineConfig.create(**kwargs)
    assert message in str(info.value)
    assert info.value.name in kwargs  # the CLI turns it into the flag's name


def test_executor_backend_follows_the_number_of_ranks():
    assert EngineConfig.create().parallel.executor_backend == "uniproc"
    assert EngineConfig.create(tensor_parallel_size=2).parallel.executor_backend == "mp"
    explicit = EngineConfig.create(tensor_parallel_size=2, distributed_executor_backend="mp")
    assert explicit.parallel.executor_backend == "mp"


def test_ray_backend_without_ray_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` sees when not installed
    with pytest.raises(InvalidSettingError, match=r"pip install 'serve\[ray\]'") as info:
        EngineConfig.create(tensor_parallel_size=2, distributed_executor_backend="ray")
    assert info.value.name == "distributed_executor_backend"


def test_ray_backend_with_ray_installed_is_accepted(monkeypatch):
    ray = types.ModuleType("ray")
    ray.__spec__ = importlib.machinery.ModuleSpec("ray", None)
    monkeypatch.setitem(sys.modules, "ray", ray)
    config = EngineConfig.create(tensor_parallel_size=2, distributed_executor_backend="ray")
    assert config.parallel.executor_backend == "ray"


def test_swap_space_beyond_ram_is_refused_and_most_of_it_warned(monkeypatch, caplog):
    monkeypatch.setattr("serve.config.physical_memory_bytes", lambda: 16 * GiB)
    with pytest.raises(InvalidSettingError) as info:
        EngineConfig.create(swap_space=17)
    assert info.value.name == "swap_space"
    assert "must fit in this machine's 16.0 GiB of RAM; got 17 GiB." in str(info.value)
    # every rank maps its own swap space
    with pytest.raises(InvalidSettingError, match="got 6 GiB for each of 3 ranks"):
        EngineConfig.create(swap_space=6, tensor_parallel_size=3)

    with caplog.at_level("WARNING", logger="serve.config"):
        EngineConfig.create(swap_space=8)  # half: quiet
        assert not caplog.records
        EngineConfig.create(swap_space=12)
    assert "--swap-space 12 GiB is 75% of this machine's 16.0 GiB of RAM" in caplog.text


# This machine's memory: the kernel's MemAvailable, capped by a container's cgroup limit.


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A fake /proc/meminfo and cgroup v2 files; returns a function that writes them."""
    meminfo = tmp_path / "meminfo"
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    monkeypatch.setattr(serve_config, "_MEMINFO", meminfo)
    monkeypatch.setattr(serve_config, "_CGROUP_LIMITS", ((limit, usage),))

    def write(available_kib: int, cgroup_limit: str | None, cgroup_usage: int = 0) -> None:
        meminfo.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n")
        if cgroup_limit is not None:
            limit.write_text(cgroup_limit + "\n")
            usage.write_text(f"{cgroup_usage}\n")

    return write


def test_mem_available_without_a_cgroup_limit(machine):
    machine(10 * (GiB >> 10), None)
    assert serve_config.available_memory_bytes() == 10 * GiB
    machine(10 * (GiB >> 10), "max", 5 * GiB)  # a cgroup without a limit
    assert serve_config.available_memory_bytes() == 10 * GiB


def test_a_containers_limit_caps_it(machine):
    machine(10 * (GiB >> 10), str(4 * GiB), 1 * GiB)
    assert serve_config.available_memory_bytes() == 3 * GiB
    machine(2 * (GiB >> 10), str(4 * GiB), 1 * GiB)  # the host has less left than the limit
    assert serve_config.available_memory_bytes() == 2 * GiB
    machine(10 * (GiB >> 10), str(4 * GiB), 5 * GiB)  # over its limit (reclaimable cache)
    assert serve_config.available_memory_bytes() == 0


def test_this_machine_has_some():
    total, available = serve_config.physical_memory_bytes(), serve_config.available_memory_bytes()
    if available is None:
        pytest.skip("no /proc/meminfo here")
    assert total and 0 < available <= total


def test_image_settings_read_vllms_forms(tmp_path):
    """limit_mm_per_prompt as vLLM writes it (a count, or {"count": ...}; 999 unset),
    vLLM's language_model_only as a limit of 0, and a local media folder that exists."""
    assert EngineConfig().multimodal.image_limit == 999
    limits = {
        '{"image": 2}': 2,
        '{"image": {"count": 3, "width": 512}}': 3,
        '{"video": 1}': 999,
        '{"image": 0}': 0,
    }
    for value, limit in limits.items():
        assert EngineConfig.create(limit_mm_per_prompt=value).multimodal.image_limit == limit
    assert EngineConfig.create(limit_mm_per_prompt={"image": 4}).multimodal.image_limit == 4
    assert EngineConfig.create(language_model_only=True).multimodal.image_limit == 0
    assert EngineConfig.create(language_model_only=False) == EngineConfig()
    for value, refused in [
        ('{"image": -1}', "integer >= 0"),
        ('{"image": true}', "integer >= 0"),
        ('{"pictures": 1}', "unknown modality"),
        ("image=2", "not valid JSON"),
    ]:
        with pytest.raises(InvalidSettingError, match=f"^limit_mm_per_prompt .*{refused}"):
            EngineConfig.create(limit_mm_per_prompt=value)
    assert EngineConfig.create(allowed_local_media_path=str(tmp_path)).multimodal
    with pytest.raises(InvalidSettingError, match="must be an existing directory"):
        EngineConfig.create(allowed_local_media_path=str(tmp_path / "absent"))


@pytest.mark.parametrize(
    ("requested", "max_model_len", "chunked", "budget"),
    [
        (None, 4096, True, 512),  # the device's default
        (None, 4096, False, 4096),  # unchunked: a whole prompt of max_model_len
        (None, 64, False, 512),
        (100, 4096, True, 100),
        (100, 64, False, 100),
        # Below max_model_len unchunked: the engine refuses it, but only once it has fitted
        # max_model_len to the cache (maybe to 100 or less); the model runner, profiling a
        # step before that, takes the budget as given.
        (100, 4096, False, 100),
    ],
)
def test_the_step_budget_is_the_flag_else_the_default_grown_to_a_whole_prompt(
    requested, max_model_len, chunked, budget
):
    assert fit_max_num_batched_tokens(requested, 512, max_model_len, chunked) == budget
