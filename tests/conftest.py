"""Shared fixtures: tiny offline models (see tiny_models.py). Nothing here touches the network."""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
from gpu_share import ENGINE_SHARE, ON_A_GPU_MACHINE  # noqa: E402 (imports only os)

# Without a GPU the Triton kernel tests run under Triton's interpreter. Triton reads this
# once, and transformers imports triton while test modules are collected, so it is set
# here, first; only the kernel tests use Triton on CPU.
if not ON_A_GPU_MACHINE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _one_gpu_shared_by_test_workers():
    """With pytest-xdist on a GPU machine, the engines a worker starts in its own process
    size their KV cache from a share of the GPU (gpu_share.py), not from 0.9 of it each.
    Engines started in a process of their own (the core process, `serve` itself) keep
    their setting."""
    if ENGINE_SHARE is None:
        yield
        return
    from serve.worker import model_runner

    share = ENGINE_SHARE
    budget = model_runner.cuda_kv_cache_budget

    def shared(total, utilization, peak, free, device="cuda"):
        return budget(total, min(utilization, share), peak, free, device)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "cuda_kv_cache_budget", shared)
        yield


@pytest.fixture(autouse=ENGINE_SHARE is not None)
def _engines_freed_after_each_test():
    """An engine's objects form cycles, so only a collection frees its KV cache: on a GPU
    shared by test workers, collect after each test rather than let caches pile up."""
    yield
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


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


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance for one test module: 2 CPUs, no dashboard, its node on
    127.0.0.1, gloo between its actors over loopback; skipped where ray is not installed."""
    # Read once, when ray is imported: off, a local node registers as 127.0.0.1 (not the
    # machine's routable address), so the tests' traffic stays on loopback.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'serve[ray]'")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RAY_ADDRESS", raising=False)
        # Ray's worker processes inherit these, to import serve and the tests' workers.
        paths = [repo, os.path.join(repo, "tests"), os.environ.get("PYTHONPATH", "")]
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
        patch.setenv("GLOO_SOCKET_IFNAME", "lo")
        # Engines earlier tests left to the collector still hold their KV caches (a default
        # CPU engine's is 4 GiB, zero-filled). Their swap space no longer counts (it is
        # mapped MAP_NORESERVE), but the caches do: a fork (Ray starts its processes with a
        # preexec_fn, so no vfork) is refused with ENOMEM under Linux's default overcommit
        # heuristic once the private mappings pass RAM + swap. Free them first.
        gc.collect()
        ray.init(num_cpus=2, include_dashboard=False)
        try:
            assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
            yield ray
        finally:
            ray.shutdown()


# CUDA errors that are sticky: every later CUDA call in the process fails with them.
STICKY_CUDA_ERRORS = (
    "an illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under xdist on a GPU, a test that meets a sticky CUDA error ends its worker: its
    context is lost, and every test it ran after would fail with the same error (one such
    error failed ~500 tests of an H100 run). xdist reports the test as the one its worker
    crashed in and starts a fresh worker for the rest. The error can come from an earlier
    kernel (CUDA reports them asynchronously): start looking at that worker's test before."""
    outcome = yield
    report = outcome.get_result()
    if not (ON_A_GPU_MACHINE and os.environ.get("PYTEST_XDIST_WORKER")):
        return
    if report.failed and call.excinfo is not None:
        message = str(call.excinfo.value)
        if any(sticky in message for sticky in STICKY_CUDA_ERRORS):
            sys.__stderr__.write(f"{item.nodeid}: sticky CUDA error, ending the worker\n")
            sys.__stderr__.flush()
            os._exit(3)


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


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    """A tiny LLaVA (CLIP tower, tiny Llama) with its image processor and tokenizer."""
    from tiny_models import make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory):
    """A tiny Qwen2-VL (its vision transformer, a tiny Qwen2 with M-RoPE)."""
    from tiny_models import make_tiny_qwen2_vl

    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))
