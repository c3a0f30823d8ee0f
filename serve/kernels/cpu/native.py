"""serve's C++ CPU kernels (`csrc/`): compiled once per machine, cached, loaded at first use.

`torch.utils.cpp_extension` builds them into `serve_cache_dir()/cpu_kernels/<key>`. The key
hashes the sources, the compiler flags, the torch version and, for the default
`-march=native`, the CPU's feature flags, so an edit, another torch or another CPU gets a
build of its own. A cached build loads directly (no compiler needed); `make install` builds
once, and processes starting together wait on one build. `SERVE_CPU_KERNELS_MARCH` picks
another target (Docker images use `x86-64-v3`, AVX2 + FMA, to run on any recent x86 CPU).

Where no compiler or ninja exists, the CPU lacks the target's instructions, or the build
fails, `available()` is False, the reason is logged once, and the ops run the torch
reference (`serve/kernels/reference.py`). `SERVE_CPU_KERNELS=0` turns them off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

from serve.config import serve_cache_dir

logger = logging.getLogger(__name__)

ENV_VAR = "SERVE_CPU_KERNELS"
MARCH_ENV_VAR = "SERVE_CPU_KERNELS_MARCH"
NAME = "serve_cpu_kernels"
CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "paged_attention.cpp",
    "linear.cpp",
    "quantized_linear.cpp",
    "elementwise.cpp",
    "decoder.cpp",
    "sampling.cpp",
    "panel_linear.cpp",
)
# What a portable target needs of the CPU it runs on (`-march=native` needs nothing).
MARCH_FEATURES = {
    "x86-64-v3": {"avx2", "fma", "f16c", "bmi2"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
}


def march() -> str:
    return os.environ.get(MARCH_ENV_VAR, "native")


def cflags() -> list[str]:
    return ["-O3", f"-march={march()}", "-fopenmp", "-std=c++17"]


# libgomp by soname: the one torch has already loaded runs the kernels' parallel loops too.
# A tuple: cpp_extension appends torch's own flags to the list it is given, which would
# change `build_key()` after the first build and send the next lookup to another build.
LDFLAGS = ("-fopenmp",)


def _cpu_features() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_key() -> str:
    """What a cached build is valid for: these sources, flags and torch, and (for a native
    build) this CPU's instruction set."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):  # the sources and the headers they include
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join([torch.__version__, *cflags(), *LDFLAGS]).encode())
    if march() == "native":
        digest.update(" ".join(sorted(_cpu_features())).encode())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    return serve_cache_dir() / "cpu_kernels" / build_key()


def _unusable() -> str | None:
    """Why the kernels cannot be built or run here, or None."""
    missing = MARCH_FEATURES.get(march(), set()) - _cpu_features()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))} ({MARCH_ENV_VAR}={march()})"
    return None


def _missing_tool() -> str | None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (install g++)"
    try:
        import ninja  # noqa: F401  (cpp_extension runs its binary)
    except ImportError:
        return "the `ninja` package is not installed"
    return None


def _build(directory: Path) -> None:
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=NAME,
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=cflags(),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )


@functools.cache
def available() -> bool:
    """Load the native kernels, building them first if no cached build fits; False (the
    reason logged once) when they cannot be had."""
    if os.environ.get(ENV_VAR, "1") == "0":
        logger.info("Native CPU kernels off (%s=0): the torch reference runs.", ENV_VAR)
        return False
    reason = _unusable()
    directory = build_dir()
    library = directory / f"{NAME}.so"
    if reason is None and library.exists():
        try:
            torch.ops.load_library(str(library))
            return True
        except OSError as exc:  # a truncated or foreign file: build again below
            logger.warning("Could not load %s (%s); rebuilding.", library, exc)
    reason = reason or _missing_tool()
    if reason is None:
        try:
            _build(directory)
            return True
        except Exception as exc:  # a compiler error, a missing header: fall back, say why
            lines = str(exc).strip().splitlines()
            reason = (
                f"the build in {directory} failed: {lines[-1] if lines else type(exc).__name__}"
            )
    logger.warning("Native CPU kernels unavailable: %s; the torch reference runs.", reason)
    return False
