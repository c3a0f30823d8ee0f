"""Kernel tests run the Triton kernels on CUDA when there is a GPU, else on CPU under Triton's
interpreter. Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when
`serve.kernels.triton` is first imported, so it is set here, at collection, before any test
imports it; nothing else in the suite uses Triton on CPU, so other tests are unaffected."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny shapes: a second intra-op thread only adds spin-waiting on a 2-core machine."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
