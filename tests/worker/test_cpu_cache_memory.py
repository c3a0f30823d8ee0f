"""The CPU KV cache is zero-filled at start: one larger than the memory available is
refused with the numbers, where it used to end the engine under the OOM killer."""

from __future__ import annotations

import re

import pytest

from serve import LLM

MiB = 1 << 20


def test_a_cache_larger_than_the_free_memory_is_refused(tiny_llama, monkeypatch):
    monkeypatch.setattr("serve.worker.model_runner.available_memory_bytes", lambda: 8 * MiB)
    message = (
        "--kv-cache-memory 16 MiB does not fit in the 8 MiB of memory available now (the "
        "model's weights loaded): lower it, e.g. --kv-cache-memory 6MiB."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(model=str(tiny_llama), kv_cache_memory="16MiB", swap_space=0.001)
    llm = LLM(model=str(tiny_llama), kv_cache_memory="4MiB", swap_space=0.001)  # fits
    assert llm.stats().num_blocks_total > 0
    llm.shutdown()
