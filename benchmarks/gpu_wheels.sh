#!/usr/bin/env bash
# Wheels for the lent GPU machine (/work/.library/device): its image has PyTorch, Triton and
# pytest but not serve's serving and test dependencies, and it cannot reach a registry. This
# downloads them (Python 3.12, manylinux x86-64) at the versions this machine's venv holds,
# into .whl/, which a device call carries and installs with
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
# (benchmarks/gpu_check.sh does that itself). Every requirement of a wheel here is either in
# the device image (as read on 2026-11-28) or in this list: a missing one (xgrammar needs
# apache-tvm-ffi) failed every test of the first call that lacked it.
#
#     benchmarks/gpu_wheels.sh [PYTHON]      # PYTHON: the venv's, default .venv/bin/python
set -euo pipefail
python=${1:-.venv/bin/python}
names=(
    transformers tokenizers fastapi starlette annotated-doc pydantic pydantic-core
    typing-inspection annotated-types typing-extensions uvicorn httptools msgspec xgrammar
    apache-tvm-ffi gguf jsonschema jsonschema-specifications referencing rpds-py
    openai anthropic httpx2 httpcore2 jiter sniffio truststore docstring-parser
    opentelemetry-api compressed-tensors loguru
)
pins=()
for name in "${names[@]}"; do
    version=$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" \
        "$name" 2>/dev/null) || { echo "skipping $name: not in $python's environment"; continue; }
    pins+=("$name==$version")
done
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${pins[@]}"
du -sh .whl
