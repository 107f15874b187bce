#!/usr/bin/env bash
# One script for a machine with an NVIDIA GPU (sm_90: H100/H200). Uses the bundle made here by
# scripts/gpu-bundle.sh (carried over: the GPU machine has nvcc, CMake and PyTorch but not
# Debian's gRPC or GoogleTest); if absent and nvcc + gtest exist, builds it.
#   1. GPU parity tests: CUDA vs CPU backend vs float64 reference, random data, every mode; the
#      Device interface test on cuda:0.
#   2. Kernel benchmark with this GPU's copy bandwidth and bf16 GEMM rate measured in the run.
#   3. PyTorch versions of the same ops on the same shapes.
#   4. One table: op, shape, time, GB/s or TFLOP/s, fraction of the limit, speed-up over PyTorch.
# Writes everything under ${OUT:-gpu-check-out}. Finishes in a few minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
BUNDLE=${BUNDLE:-build-gpu/bundle}
if [ ! -x "$BUNDLE/cuda_test" ]; then
  echo "gpu-check: no bundle at $BUNDLE; building (needs this repo's dependencies)"
  ./scripts/gpu-bundle.sh || { echo "gpu-check: cannot build the bundle"; exit 1; }
fi
export LD_LIBRARY_PATH="$PWD/$BUNDLE/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
status=0
echo "== parity tests"
timeout 300 "$BUNDLE/cuda_test" --gtest_output="xml:$OUT/cuda_test.xml" 2>&1 | tee "$OUT/cuda_test.log" | \
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|error' | head -60
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "== the Device interface driven on cuda:0 next to cpu:0 (as the engine drives it)"
timeout 120 "$BUNDLE/device_test" --gtest_filter='*cuda*' --gtest_output="xml:$OUT/device_test.xml" \
  2>&1 | tee "$OUT/device_test.log" | grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure' | head -30
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "== parity tests with the tensor-core MLA kernel (ATTND_CUDA_MLA=mma; not yet the default)"
ATTND_CUDA_MLA=mma timeout 300 "$BUNDLE/cuda_test" --gtest_filter='*BF16*:Cuda.*' \
  --gtest_output="xml:$OUT/cuda_test_mma.xml" 2>&1 | tee "$OUT/cuda_test_mma.log" | \
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure' | head -40
[ "${PIPESTATUS[0]}" -eq 0 ] || echo "gpu-check: the tensor-core MLA kernel fails parity (see $OUT/cuda_test_mma.log)"
if command -v compute-sanitizer >/dev/null 2>&1; then
  echo "== compute-sanitizer (memcheck) on one parity case"
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 "$BUNDLE/cuda_test" \
    --gtest_filter='Modes/CudaParity.MatchesReferenceAndCpuBackend/token_BF16' 2>&1 | tail -8 || status=1
fi
echo "== kernel benchmark"
BENCH="$BUNDLE/cuda_bench"
if ! "$BUNDLE/cuda_test" --gtest_list_tests >/dev/null 2>&1; then
  # The carried binaries do not load here (e.g. an older glibc): the benchmark needs only nvcc.
  echo "gpu-check: carried binaries do not load; building cuda_bench with nvcc"
  nvcc -O3 -std=c++17 -arch=sm_90 -I. bench/cuda_bench.cc kernels/cuda/cuda_kernels.cu \
    -o "$OUT/cuda_bench" && BENCH="$OUT/cuda_bench"
fi
timeout 300 "$BENCH" --json="$OUT/cuda_bench.jsonl" || status=1
echo "== PyTorch versions"
timeout 300 python3 bench/torch_ref.py --json "$OUT/torch.jsonl" || echo "gpu-check: PyTorch timing failed"
echo "== table"
python3 bench/gpu_report.py "$OUT/cuda_bench.jsonl" "$OUT/torch.jsonl" "$OUT/cuda_test.xml" | tee "$OUT/table.md"
exit $status
