"""Shared fixtures: tiny offline models (see tiny_models.py). Nothing here touches the network."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without a GPU the Triton kernel tests run under Triton's interpreter. Triton reads this
# once, and transformers imports triton while test modules are collected, so it is set
# here, first; only the kernel tests use Triton on CPU.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """`(arch, **overrides) -> Path`: a saved tiny model, built once per distinct arguments."""
    # Imported here so test runs that need no model (scheduler, allocator) never load torch.
    from tiny_models import make_tiny_model

    built = {}

    def factory(arch: str, **overrides):
        key = json.dumps([arch, overrides], sort_keys=True, default=repr)
        if key not in built:
            out_dir = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = make_tiny_model(arch, out_dir, **overrides)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_model_factory):
    return tiny_model_factory("mistral")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_factory):
    return tiny_model_factory("qwen2")


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA; without it they are skipped, not failed."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return  # torch stays unimported for runs that need no model
    import torch

    if not torch.cuda.is_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(scope="session")
def tp2_ranks():
    """Two CPU ranks in one gloo tensor-parallel group, started once (see rank_pool.py)."""
    from rank_pool import RankPool

    with RankPool(world_size=2) as pool:
        yield pool
