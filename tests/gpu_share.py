"""One GPU shared by pytest-xdist's workers: the share of it each worker's engines size
their KV cache from (conftest.py applies it), or None where the tests run in one process
or on a machine without a GPU."""

from __future__ import annotations

import os

ON_A_GPU_MACHINE = os.path.exists("/dev/nvidiactl")
TEST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# Half the GPU for all workers' engines together; the rest is the kernel tests' tensors and
# the CUDA contexts.
ENGINE_SHARE: float | None = (
    int(50_000 / TEST_WORKERS) / 100_000 if ON_A_GPU_MACHINE and TEST_WORKERS > 1 else None
)
