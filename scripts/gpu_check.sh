#!/usr/bin/env bash
# GPU check for the Triton kernels. On a CUDA machine, from the repository root:
#   scripts/gpu_check.sh            # results under $OUT if set, else ./results/gpu_check
# 1. the kernel tests compiled natively (no TRITON_INTERPRET), incl. a >2^31-element cache test
# 2. end-to-end greedy generation on tiny checkpoints vs transformers (tests/kernels/test_backend.py)
# 3. the engine on CUDA through the public API (scripts/gpu_e2e.py), the runner in a thread and in
#    its own process: greedy tokens vs transformers on the built-in model, preemption by swap,
#    fp32 / bf16 throughput, and (thread) a profiled fp32 run (cProfile, the GPU's kernels)
# 4. paged decode attention benchmark: GB/s and the ratio to contiguous SDPA
# 5. `bench overhead` on CUDA (host time per step at 256 sequences): the runner in a
#    thread with async scheduling off, CUDA graphs on and off; async scheduling on in the thread;
#    in its own process with async scheduling on and off, graphs on and off
# 6. the engine on a Qwen3-0.6B-shaped bf16 model with its defaults (the KV cache sized by
#    gpu_memory_utilization, graphs, the runner's process): the Triton cache in NHD against the
#    runner layout, tok/s (scripts/gpu_shape_bench.py)
# 7. quantized weights on CUDA: the Triton quantized-matmul tests compiled natively
#    (tests/kernels/test_triton_quant_matmul.py) and the engine on tiny GGUF Q8_0 / Q4_K and
#    compressed-tensors W4A16 checkpoints: greedy tokens and logprobs vs transformers
#    (tests/kernels/test_quantized_engine_triton.py)
# 8. quantized matmul benchmark: the Triton kernels vs torch float32 / bf16 on dequantized weights
#    (asyncpaged.kernels.triton_quant_matmul_bench)
# Run in the order 7, 8, 1+2, 5, 3, 4, 6 (what has never run on a GPU first: a device lease that
# ends early still brings those back). Budget: under 10 minutes (stages 1-5 took 141 s on an H100
# before stage 5 grew to six runs and stage 3 to two; stage 6 may take 5; stages 7-8 have not run
# on a GPU yet: their timeouts are 300 s and 150 s); each stage has its own timeout.
# Python: $PYTHON, else .venv if its torch sees CUDA, else python3. A package that Python lacks
# (structlog, say) is installed from wheels in .whl/ when that folder exists.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
RESULTS="${OUT:-$PWD/results/gpu_check}"
mkdir -p "$RESULTS"
if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  PY=.venv/bin/python
else
  PY=python3
fi

log() { printf '\n=== %s ===\n' "$*" | tee -a "$RESULTS/summary.txt"; }

log "environment ($PY)"
"$PY" - <<'PYEOF' 2>&1 | tee -a "$RESULTS/summary.txt"
import sys
import torch, transformers, triton
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__)
if not torch.cuda.is_available():
    sys.exit("FAIL: torch sees no CUDA device (need a CUDA build of torch; set PYTHON=...)")
print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
PYEOF
export PYTHONUNBUFFERED=1
if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/asyncpaged-site .whl/*.whl
  export PYTHONPATH="/tmp/asyncpaged-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c 'import asyncpaged.kernels' 2>/dev/null; then
  echo "asyncpaged not importable with $PY: installing the repo (editable, no deps)"
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -5 || true
fi
if ! "$PY" -c 'import asyncpaged.kernels' 2>/dev/null; then
  echo "the editable install did not take: using a copy of the package (kernels/csrc inside it)"
  rm -rf /tmp/asyncpaged-src && mkdir -p /tmp/asyncpaged-src
  cp -r src/asyncpaged /tmp/asyncpaged-src/ && cp -r kernels/csrc /tmp/asyncpaged-src/asyncpaged/kernels/csrc
  export PYTHONPATH="/tmp/asyncpaged-src${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c 'import asyncpaged.kernels'
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee -a "$RESULTS/summary.txt" || true

status=0
# run_stage LABEL LOG FILTER SECONDS CMD...: CMD under a timeout, its output shown and kept in
# $RESULTS/LOG; then LOG's lines matching FILTER go to the summary, or a FAIL line and status 1.
run_stage() {
  local label=$1 logfile=$RESULTS/$2 filter=$3 limit=$4
  shift 4
  if timeout "$limit" "$@" 2>&1 | tee "$logfile"; then
    grep -E "$filter" "$logfile" >> "$RESULTS/summary.txt" || true
  else
    status=1
    echo "$label: FAIL (see $(basename "$logfile"))" | tee -a "$RESULTS/summary.txt"
  fi
}
export ASYNCPAGED_KERNELS_NATIVE=1
unset TRITON_INTERPRET
QUANT_TESTS=(tests/kernels/test_triton_quant_matmul.py tests/kernels/test_quantized_engine_triton.py)

log "7. quantized weights on CUDA: Triton quantized-matmul tests natively + engine vs transformers"
# -W default: a deprecation warning of another torch / transformers version is shown, not fatal.
run_stage "quantized tests" quantized_tests.log '(passed|failed)' 300 \
  "$PY" -m pytest "${QUANT_TESTS[@]}" -q -n 4 -p no:cacheprovider --timeout 250 -W default \
  --junitxml="$RESULTS/quantized_tests.xml"

log "8. quantized matmul benchmark (Triton vs torch float32 / bf16 on dequantized weights)"
run_stage "quantized benchmark" bench_quant.log '^(Q|int4|fp8)' 150 \
  "$PY" -m asyncpaged.kernels.triton_quant_matmul_bench --json "$RESULTS/bench_quant.json"

log "1+2. kernel tests natively + end-to-end vs transformers, swap ordering on a side stream"
if timeout 240 "$PY" -m pytest tests/kernels tests/model/test_swap_ordering_cuda.py -q -n 4 \
    -p no:cacheprovider --timeout 200 -W default \
    --ignore=tests/kernels/test_packaging.py --ignore=tests/kernels/test_cpu_attention.py \
    --ignore=tests/kernels/test_cpu_fused.py --ignore="${QUANT_TESTS[0]}" \
    --ignore="${QUANT_TESTS[1]}" \
    --junitxml="$RESULTS/kernel_tests.xml" 2>&1 | tee "$RESULTS/kernel_tests.log"; then
  echo "kernel tests: PASS" | tee -a "$RESULTS/summary.txt"
else
  status=1
  echo "kernel tests: FAIL (see kernel_tests.log)" | tee -a "$RESULTS/summary.txt"
fi
tail -3 "$RESULTS/kernel_tests.log" >> "$RESULTS/summary.txt" || true

log "5. engine overhead per step on CUDA, 256 sequences: runner in a thread / a process,"
log "   async scheduling off / on, CUDA graphs on (the default) / off (eager)"
for run in thread:off:graphs thread:off:eager thread:on:graphs process:on:graphs process:off:graphs \
    process:on:eager; do
  IFS=: read -r backend ahead graphs <<<"$run"
  name="overhead_${backend}_async_${ahead}_${graphs}"
  eager=()
  [[ "$graphs" == eager ]] && eager=(--enforce-eager)
  run_stage "bench overhead ($run)" "$name.log" '^median' 75 \
    "$PY" -m asyncpaged bench overhead --device cuda --repeats 3 ${eager[@]+"${eager[@]}"} \
    --executor-backend "$backend" --async-scheduling "$ahead" --output "$RESULTS/$name"
done

log "3. engine end-to-end on CUDA (scripts/gpu_e2e.py), the runner in a thread (profiled) and in its process"
for executor in thread process; do
  profile=()
  [[ "$executor" == thread ]] && profile=(--profile)
  run_stage "end-to-end ($executor)" "e2e_$executor.log" '^[0-9]\.' 150 \
    "$PY" scripts/gpu_e2e.py --executor-backend "$executor" ${profile[@]+"${profile[@]}"} \
    --out "$RESULTS/e2e_$executor.json"
done

log "4. paged decode benchmark"
run_stage benchmark bench_decode.log '' 120 \
  "$PY" -m asyncpaged.kernels.benchmark --out "$RESULTS/bench_decode.json"

log "6. the engine on a Qwen3-0.6B-shaped bf16 model (scripts/gpu_shape_bench.py): NHD vs runner layout"
run_stage "shape bench" shape_bench.log '^(round|6\.)' 300 \
  "$PY" scripts/gpu_shape_bench.py --out "$RESULTS/shape_bench.json"

log "done: status $status, results in $RESULTS"
exit "$status"
