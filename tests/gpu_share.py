"""One GPU shared by pytest-xdist's workers: the share of it each worker's engines size
their KV cache from (conftest.py applies it), or None where the tests run in one process
or on a machine without a GPU. And the device that engines at two ranks run on."""

from __future__ import annotations

import os

ON_A_GPU_MACHINE = os.path.exists("/dev/nvidiactl")
TEST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# Half the GPU for all workers' engines together; the rest is the kernel tests' tensors and
# the CUDA contexts.
ENGINE_SHARE: float | None = (
    int(50_000 / TEST_WORKERS) / 100_000 if ON_A_GPU_MACHINE and TEST_WORKERS > 1 else None
)


def _gpu_count() -> int:
    """The GPUs this process sees, without torch: /dev/nvidiaN, fewer where
    CUDA_VISIBLE_DEVICES names fewer."""
    try:
        names = os.listdir("/dev")
    except OSError:
        return 0
    found = sum(1 for name in names if name.startswith("nvidia") and name[6:].isdigit())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    return min(found, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))


GPU_COUNT = _gpu_count()
# serve runs one rank a GPU and refuses two ranks on a one-GPU machine: there, engines at two
# ranks run two CPU ranks over gloo, as on a machine without a GPU (CI).
TWO_RANK_DEVICE = "auto" if GPU_COUNT >= 2 else "cpu"
