"""Which implementation runs a kernel op: Triton on CUDA tensors, serve's CPU ops elsewhere.

`SERVE_KERNEL_BACKEND` overrides the choice. It is read at a process's first kernel call on
each device, and the choice kept: a decode step makes hundreds of kernel calls, and reading the
environment at each one cost 3-8% of a batch-1 step on CPU. (Tests that flip it clear the
cache: `ops_for.cache_clear()`.)

| value        | CUDA tensors | CPU tensors                                        |
|--------------|--------------|----------------------------------------------------|
| `auto` / ""  | Triton       | `serve.kernels.cpu`: native C++ where built, else reference |
| `reference`  | reference    | reference                                          |
| `triton`     | Triton       | Triton under the interpreter (`TRITON_INTERPRET=1`) |

The Triton package is imported on first use, so `import serve` and CPU runs never load it.
"""

from __future__ import annotations

import enum
import functools
import importlib
import os
from types import ModuleType

import torch

from serve.kernels import cpu, reference

BACKEND_ENV_VAR = "SERVE_KERNEL_BACKEND"
INTERPRETER_ENV_VAR = "TRITON_INTERPRET"


class Backend(enum.Enum):
    AUTO = "auto"
    REFERENCE = "reference"
    TRITON = "triton"


def requested_backend() -> Backend:
    value = os.environ.get(BACKEND_ENV_VAR, "").strip().lower() or Backend.AUTO.value
    try:
        return Backend(value)
    except ValueError:
        choices = ", ".join(b.value for b in Backend)
        raise ValueError(f"{BACKEND_ENV_VAR}={value!r}: expected one of {choices}.") from None


def is_interpreting() -> bool:
    """Triton's CPU interpreter is on. Triton reads this when a kernel is decorated, i.e. when
    `serve.kernels.triton` is first imported, so it must be set before that."""
    return os.environ.get(INTERPRETER_ENV_VAR, "0") == "1"


@functools.cache
def ops_for(device: torch.device) -> ModuleType:
    """The module whose functions run the ops for tensors on `device`: `serve.kernels.cpu`,
    `serve.kernels.reference` or `serve.kernels.triton`, all with the same function names
    and signatures. Decided once per device (`ops_for.cache_clear()` decides again)."""
    backend = requested_backend()
    if backend is Backend.REFERENCE:
        return reference
    if backend is Backend.AUTO and device.type != "cuda":
        return cpu
    if device.type != "cuda" and not is_interpreting():
        raise RuntimeError(
            f"{BACKEND_ENV_VAR}=triton on {device.type} tensors needs Triton's interpreter: "
            f"set {INTERPRETER_ENV_VAR}=1 before the first kernel call (it is read at import)."
        )
    return importlib.import_module("serve.kernels.triton")
