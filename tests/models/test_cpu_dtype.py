"""Which dtype a checkpoint runs in: as asked, else the checkpoint's, except that a CPU
without bf16 in hardware runs half-precision checkpoints in float32 (faster there)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from serve.models import loader

CPU = torch.device("cpu")
BF16_CHECKPOINT = SimpleNamespace(dtype="bfloat16")


@pytest.fixture(params=[False, True], ids=["no-bf16-hardware", "bf16-hardware"])
def native_bf16(request, monkeypatch) -> bool:
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: request.param)
    return request.param


def test_auto_on_cpu_follows_the_hardware_and_says_so(native_bf16, caplog):
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        dtype = loader.resolve_dtype("auto", BF16_CHECKPOINT, CPU)
    assert dtype == (torch.bfloat16 if native_bf16 else torch.float32)
    assert "The checkpoint is bfloat16" in caplog.text
    assert ("bf16 in hardware" if native_bf16 else "no AVX512_BF16 or AMX") in caplog.text


def test_auto_keeps_float32_checkpoints_and_gpu_dtypes(native_bf16):
    assert loader.resolve_dtype("auto", SimpleNamespace(dtype="float32"), CPU) == torch.float32
    assert loader.resolve_dtype("auto", BF16_CHECKPOINT, torch.device("cuda")) == torch.bfloat16
    assert loader.resolve_dtype("auto", SimpleNamespace(), CPU) == torch.float32


def test_an_explicit_dtype_wins_with_a_warning_where_it_is_slow(native_bf16, caplog):
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        assert loader.resolve_dtype("bfloat16", SimpleNamespace(dtype="float32"), CPU) == (
            torch.bfloat16
        )
    assert ("runs slower" in caplog.text) is not native_bf16


def test_a_float32_checkpoint_where_bf16_is_in_hardware_gets_a_hint(native_bf16, caplog):
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        dtype = loader.resolve_dtype("auto", SimpleNamespace(dtype="float32"), CPU)
    assert dtype == torch.float32  # kept: token for token what transformers computes
    assert ("--dtype bfloat16 serves it faster" in caplog.text) is native_bf16
