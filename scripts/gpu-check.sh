#!/usr/bin/env bash
# One script for a machine with an NVIDIA GPU (sm_80/sm_90). Uses the bundle made here by
# scripts/gpu-bundle.sh (carried over: the GPU machine has nvcc, CMake and PyTorch but not
# Debian's gRPC or GoogleTest); if absent and nvcc + gtest exist, builds it.
#   1. GPU tests: CUDA vs CPU backend vs float64 reference, random data, every mode; the Device
#      interface test on cuda:0; the tensor-core MLA kernel's parity pass.
#   2. Failing tests again, one process each with CUDA_LAUNCH_BLOCKING=1 (names the kernel).
#   3. compute-sanitizer memcheck on one case, when a probe shows it works on this host.
#   4. Kernel benchmark with this GPU's copy bandwidth measured in the run; PyTorch versions of
#      the same ops on the same shapes.
#   5. One table: op, shape, time, GB/s or TFLOP/s, fraction of the limit, speed-up over PyTorch.
# Everything goes under ${OUT:-gpu-check-out}; logs are written to files before anything filters
# them. Where nvidia-smi lists a GPU, ATTND_REQUIRE_GPU=1 makes every GPU skip a failure.
# Stages stop being started once ${GPU_CHECK_BUDGET_S:-660} seconds have passed (the session's
# device time is 15 minutes). --dry-run goes through every stage without a GPU (what this CPU
# machine can check): the report then ends with "no GPU: nothing measured".
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = --dry-run ] && DRY=1
OUT=${OUT:-gpu-check-out}
BUDGET=${GPU_CHECK_BUDGET_S:-660}
mkdir -p "$OUT"
BUNDLE=${BUNDLE:-build-gpu/bundle}
if [ ! -x "$BUNDLE/cuda_test" ]; then
  echo "gpu-check: no bundle at $BUNDLE; building (needs this repo's dependencies)"
  ./scripts/gpu-bundle.sh || { echo "gpu-check: cannot build the bundle"; exit 1; }
fi
export LD_LIBRARY_PATH="$PWD/$BUNDLE/lib:${LD_LIBRARY_PATH:-}"
status=0
if nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    > "$OUT/nvidia-smi.txt" 2>&1 && [ -s "$OUT/nvidia-smi.txt" ]; then
  cat "$OUT/nvidia-smi.txt"
  export ATTND_REQUIRE_GPU=1
  echo "gpu-check: a GPU is listed: GPU tests may not skip (ATTND_REQUIRE_GPU=1)"
elif [ $DRY = 1 ]; then
  echo "gpu-check: --dry-run without a GPU: every stage runs, GPU tests skip"
else
  echo "gpu-check: nvidia-smi lists no GPU; use --dry-run to go through the stages anyway"
  exit 1
fi
in_budget() {  # in_budget STAGE: whether there is time left to start STAGE
  if [ "$SECONDS" -ge "$BUDGET" ]; then
    echo "gpu-check: $1 not started: ${SECONDS}s of the ${BUDGET}s budget used"
    status=1
    return 1
  fi
}
# run_tests NAME BINARY TIMEOUT [gtest args...]: full log to a file first, then a summary.
run_tests() {
  local name=$1 bin=$2 limit=$3
  shift 3
  timeout "$limit" "$bin" --gtest_output="xml:$OUT/$name.xml" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -E '^\[  (FAILED|SKIPPED) |^\[==========\]|^\[  PASSED  \]' "$OUT/$name.log" | head -40
  [ $rc -eq 124 ] && echo "gpu-check: $name timed out after ${limit}s"
  return $rc
}
echo "== GPU tests"
in_budget "GPU tests" && { run_tests cuda_test "$BUNDLE/cuda_test" 240 || status=1; }
in_budget "GPU tests at real dimensions" && \
  { run_tests cuda_scale_test "$BUNDLE/cuda_scale_test" 240 || status=1; }
in_budget "device interface tests" && \
  { run_tests device_test "$BUNDLE/device_test" 120 --gtest_filter='*cuda*' || status=1; }
echo "== failing tests one by one with CUDA_LAUNCH_BLOCKING=1 (a faulting kernel poisons its process)"
for name in cuda_test cuda_scale_test device_test; do
  [ -f "$OUT/$name.xml" ] || continue
  python3 - "$OUT/$name.xml" > "$OUT/$name.failed" <<'PY'
import sys, xml.etree.ElementTree as ET
for s in ET.parse(sys.argv[1]).getroot().iter("testsuite"):
    for c in s.iter("testcase"):
        if c.find("failure") is not None:
            print(f"{s.get('name')}.{c.get('name')}")
PY
  while read -r t; do
    in_budget "rerun of $t" || break
    echo "-- $t"
    CUDA_LAUNCH_BLOCKING=1 timeout 60 "$BUNDLE/$name" --gtest_filter="$t" \
      > "$OUT/rerun.$t.log" 2>&1
    grep -E 'Failure|CUDA|error|\[  (PASSED|FAILED) ' "$OUT/rerun.$t.log" | head -12
  done < "$OUT/$name.failed"
done
echo "== the SIMT kernels for bf16 (ATTND_CUDA_MLA=simt ATTND_CUDA_INDEXER=simt; the default is tensor cores)"
if in_budget "SIMT parity"; then
  ATTND_CUDA_MLA=simt ATTND_CUDA_INDEXER=simt run_tests cuda_test_simt "$BUNDLE/cuda_test" 180 \
    --gtest_filter='*BF16*:Cuda.*' ||
    { echo "gpu-check: the SIMT kernels fail parity too (see $OUT/cuda_test_simt.log)"; status=1; }
fi
echo "== compute-sanitizer (memcheck) on one case"
if ! command -v compute-sanitizer >/dev/null 2>&1; then
  echo "gpu-check: compute-sanitizer not installed: skipped"
elif ! timeout 60 compute-sanitizer --tool memcheck "$BUNDLE/cuda_test" --gtest_list_tests \
    > "$OUT/sanitizer-probe.log" 2>&1; then
  echo "gpu-check: compute-sanitizer does not work on this host (see $OUT/sanitizer-probe.log): skipped"
elif [ $DRY = 0 ] && in_budget "compute-sanitizer"; then
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 "$BUNDLE/cuda_test" \
    --gtest_filter='Modes/CudaParity.MatchesReferenceAndCpuBackend/token_BF16' \
    > "$OUT/sanitizer.log" 2>&1 || status=1
  tail -8 "$OUT/sanitizer.log"
fi
echo "== kernel benchmark"
BENCH="$BUNDLE/cuda_bench"
if ! "$BUNDLE/cuda_test" --gtest_list_tests >/dev/null 2>&1; then
  # The carried binaries do not load here (e.g. an older glibc): the benchmark needs only nvcc.
  echo "gpu-check: carried binaries do not load; building cuda_bench with nvcc"
  nvcc -O3 -std=c++17 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
    -I. bench/cuda_bench.cc kernels/cuda/*.cu -o "$OUT/cuda_bench" && BENCH="$OUT/cuda_bench"
fi
: > "$OUT/cuda_bench.jsonl"
if in_budget "kernel benchmark"; then
  timeout 180 "$BENCH" --json="$OUT/cuda_bench.jsonl" > "$OUT/cuda_bench.log" 2>&1 || status=1
  tail -20 "$OUT/cuda_bench.log"
fi
echo "== PyTorch versions"
: > "$OUT/torch.jsonl"
if [ -s "$OUT/cuda_bench.jsonl" ] && in_budget "PyTorch versions"; then
  timeout 180 python3 bench/torch_ref.py --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1 ||
    echo "gpu-check: PyTorch timing failed (see $OUT/torch.log)"
else
  echo "gpu-check: nothing measured on a GPU: PyTorch versions skipped"
fi
echo "== table"
python3 bench/gpu_report.py "$OUT/cuda_bench.jsonl" "$OUT/torch.jsonl" "$OUT/cuda_test.xml" \
  "$OUT/cuda_scale_test.xml" "$OUT/device_test.xml" | tee "$OUT/table.md"
echo "gpu-check: ${SECONDS}s"
[ $DRY = 1 ] && exit 0
exit $status
