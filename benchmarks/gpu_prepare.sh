#!/usr/bin/env bash
# What a call of the lent GPU machine (/work/.library/device) carries for
# benchmarks/gpu_check.sh, made here: the machine's image has PyTorch, Triton and pytest but
# not serve's serving and test dependencies, cannot reach a registry, and has no model.
#   .whl/       wheels (Python 3.12, manylinux x86-64) at the versions this machine's venv
#               holds; gpu_check.sh installs them first. Every requirement of a wheel here
#               is in the device image (as read on 2026-11-28) or in this list: one missing
#               (xgrammar needs apache-tvm-ffi) failed every test of a call.
#   .gpu_base/  the default model's config and tokenizer (no weights), the base of the
#               random-weight model gpu_check.sh times.
# Both are ignored by git (.git/info/exclude), so a call names them in `carry`:
#     run(command="benchmarks/gpu_check.sh /tmp/gc .gpu_base; tar -czf $OUT/gpu_check.tgz -C /tmp gc",
#         carry=[".whl", ".gpu_base"], timeout_s=580)
# (the logs come back as one archive: a call returns at most 8 files).
#
#     benchmarks/gpu_prepare.sh [PYTHON]      # PYTHON: the venv's, default .venv/bin/python
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
mkdir -p .whl .gpu_base .git/info
for ignored in /.whl/ /.gpu_base/; do
    grep -qx "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >>.git/info/exclude
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${pins[@]}"
du -sh .whl
model=$("$python" -c "from serve.models.default_model import resolve_default_model as r; print(r())")
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
    if [ -f "$model/$f" ]; then cp "$model/$f" .gpu_base/; fi
done
ls .gpu_base
