"""One valid, non-default value for every engine setting, as a command line writes it and
as `LLM(...)` / `EngineConfig.create(...)` takes it. test_config.py and api/test_cli.py
check that both forms reach the config; a new setting needs a line here."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass

from serve.config import EngineConfig


@dataclass(frozen=True)
class Example:
    argv: tuple[str, ...]  # the flag as typed
    value: object  # the keyword's value, and what the config holds


EXAMPLES = {
    "model": Example(("--model", "/models/tiny"), "/models/tiny"),
    "tokenizer": Example(("--tokenizer", "/models/tok"), "/models/tok"),
    "dtype": Example(("--dtype", "bfloat16"), "bfloat16"),
    "max_model_len": Example(("--max-model-len", "2048"), 2048),
    "seed": Example(("--seed", "7"), 7),
    "generation_config": Example(("--generation-config", "vllm"), "vllm"),
    "override_generation_config": Example(
        ("--override-generation-config", '{"temperature": 0.5}'), '{"temperature": 0.5}'
    ),
    "load_format": Example(("--load-format", "safetensors"), "safetensors"),
    "max_logprobs": Example(("--max-logprobs", "5"), 5),
    "allow_pickle_weights": Example(("--allow-pickle-weights",), True),
    "model_impl": Example(("--model-impl", "transformers"), "transformers"),
    "quantization": Example(("--quantization", "gptq"), "gptq"),
    "pooling_type": Example(("--pooling-type", "mean"), "mean"),
    "pooling_normalize": Example(("--no-pooling-normalize",), False),
    "block_size": Example(("--block-size", "32"), 32),
    "kv_cache_memory": Example(("--kv-cache-memory", "512MiB"), "512MiB"),
    "gpu_memory_utilization": Example(("--gpu-memory-utilization", "0.5"), 0.5),
    "num_gpu_blocks_override": Example(("--num-gpu-blocks-override", "100"), 100),
    "swap_space": Example(("--swap-space", "2.5"), 2.5),
    "enable_prefix_caching": Example(("--no-enable-prefix-caching",), False),
    "kv_cache_dtype": Example(("--kv-cache-dtype", "bfloat16"), "bfloat16"),
    "max_num_seqs": Example(("--max-num-seqs", "8"), 8),
    "max_num_batched_tokens": Example(("--max-num-batched-tokens", "1024"), 1024),
    "preemption_mode": Example(("--preemption-mode", "recompute"), "recompute"),
    "enable_chunked_prefill": Example(("--no-enable-chunked-prefill",), False),
    "async_scheduling": Example(("--no-async-scheduling",), False),
    "scheduling_policy": Example(("--scheduling-policy", "priority"), "priority"),
    "sjf_max_wait_s": Example(("--sjf-max-wait-s", "12.5"), 12.5),
    "tensor_parallel_size": Example(("--tensor-parallel-size", "2"), 2),
    "distributed_executor_backend": Example(("--distributed-executor-backend", "mp"), "mp"),
    "response_store_max_entries": Example(("--response-store-max-entries", "16"), 16),
    "response_store_ttl_s": Example(("--response-store-ttl-s", "90.5"), 90.5),
    "speculative_config": Example(
        ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'),
        '{"method": "ngram", "num_speculative_tokens": 3}',
    ),
    "enable_lora": Example(("--enable-lora",), True),
    "max_loras": Example(("--max-loras", "3"), 3),
    "max_lora_rank": Example(("--max-lora-rank", "64"), 64),
    "max_cpu_loras": Example(("--max-cpu-loras", "4"), 4),
    "limit_mm_per_prompt": Example(("--limit-mm-per-prompt", '{"image": 2}'), '{"image": 2}'),
    "mm_processor_kwargs": Example(
        ("--mm-processor-kwargs", '{"max_pixels": 1003520}'), '{"max_pixels": 1003520}'
    ),
    "allowed_local_media_path": Example(("--allowed-local-media-path", "/tmp"), "/tmp"),
    "device": Example(("--device", "cpu"), "cpu"),
    "cuda_graphs": Example(("--no-cuda-graphs",), False),
    "log_stats": Example(("--no-log-stats",), False),
}


def config_fields() -> list[tuple[str | None, str, object]]:
    """(section, name, default) for every field of every config class, read from the
    dataclasses themselves: `section` is EngineConfig's field holding it, None for its own."""
    found = []
    for section in fields(EngineConfig):
        default = getattr(EngineConfig(), section.name)
        if is_dataclass(default):
            found += [(section.name, f.name, f.default) for f in fields(default)]
        else:
            found.append((None, section.name, section.default))
    return found
