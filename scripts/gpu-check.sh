#!/usr/bin/env bash
# One script for a machine with an NVIDIA GPU (sm_80/sm_90), sized to the device window: a
# session has 15 minutes of device time and one command at most 600 s, so the default budget
# (GPU_CHECK_BUDGET_S, 420 s) leaves room for the machine's start and a rerun. Uses the bundle
# made here by scripts/gpu-bundle.sh (carried over: the GPU machine has the driver, not Debian's
# gRPC or GoogleTest); if absent and nvcc + gtest exist, builds it.
#   1. GPU tests: CUDA vs CPU backend vs float64 reference, random data, every mode (bf16 on the
#      tensor-core kernels, the default); real dimensions; the Device interface on cuda:0.
#   2. Failing tests again, one process each with CUDA_LAUNCH_BLOCKING=1 (names the kernel),
#      at most GPU_CHECK_RERUNS (4) of them and GPU_CHECK_RERUN_S (90) seconds in all.
#   3. The SIMT kernels on the bf16 cases that stage 1 ran on tensor cores (ATTND_CUDA_MLA=simt
#      ATTND_CUDA_INDEXER=simt): both kernel families against the same references.
#   4. compute-sanitizer, when a probe that launches a real kernel shows it works here
#      ("not supported" is read as unavailable, not as a failure): memcheck on one
#      DeepSeek-dims case, racecheck and synccheck on one tensor-core step.
#   5. Kernel benchmark with this GPU's copy bandwidth measured in the run; PyTorch versions of
#      the same ops on the same shapes.
#   6. Nsight Compute (ncu, where installed) on one launch each of the sparse MLA (the form the
#      benchmark found fastest among those matching SIMT; else its wgmma form), the streaming
#      indexer and the top-k kernels: occupancy, issue rate, stalls, memory throughput.
#   7. End to end: attnd on the GPU with attnctl bench against it (B = 64, 8K context, DeepSeek
#      dims): the server's layer time beside its round trip, bf16 (default and library kernels)
#      and fp8 caches.
#   8. The UCX data plane's transport on this host's CPUs (issue #54's measurement wants cores to
#      spare for the progress threads, which the 2-core development VM lacks): bench/
#      transport_bench.py against a CPU attnd of the bundle, batch 8 and 64 (transport.md);
#      then, budget allowing, batch 64 with outputs pushed (--data-plane-push, transport-push.md)
#      and with a 5 ms poll (ATTND_UCX_SPIN_US, transport-spin5000.md).
#   9. One table: the stages (limit, time, verdict), the tests, op, shape, time, GB/s or TFLOP/s,
#      fraction of the limit, speed-up over PyTorch; then the sparse MLA's forms ranked and which
#      to make the default ("MLA choice"). Every file also in gpu-check-logs.tgz.
# A stage starts only when its time limit fits what is left of the budget; every command runs
# under `timeout -k`, so a hung kernel cannot hold the window. Everything goes under
# ${OUT:-gpu-check-out} (stages.jsonl: one line per stage); logs are written to files before
# anything filters them. Where nvidia-smi lists a GPU, ATTND_REQUIRE_GPU=1 makes every GPU skip a
# failure. --dry-run goes through every stage without a GPU (what the CPU machine can check):
# the report then ends with "no GPU: nothing measured".
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = --dry-run ] && DRY=1
OUT=${OUT:-gpu-check-out}
BUDGET=${GPU_CHECK_BUDGET_S:-420}
MAX_RERUNS=${GPU_CHECK_RERUNS:-4}
# GPU_CHECK_ONLY: the groups to run (a kernel iteration: tests,bench,profile); GPU_CHECK_FILTER: a
# gtest filter for the GPU test binaries (e.g. '*DeepSeekDims*:*CudaParity*'); the device
# interface tests run only unfiltered.
ONLY=${GPU_CHECK_ONLY:-tests,simt,sanitizer,bench,torch,e2e,profile,transport}
FILTER=${GPU_CHECK_FILTER:-*}
RERUN_BUDGET=${GPU_CHECK_RERUN_S:-90}
KILL_AFTER=5  # seconds between timeout's TERM and its KILL
mkdir -p "$OUT"
STAGES="$OUT/stages.jsonl"
: > "$STAGES"
BUNDLE=${BUNDLE:-build-gpu/bundle}
if [ ! -x "$BUNDLE/cuda_test" ] && [ -f "$BUNDLE/bundle.tgz" ]; then  # as gpu-bundle.sh packs it
  unpacked=${TMPDIR:-/tmp}/attnd-gpu-bundle
  rm -rf "$unpacked" && mkdir -p "$unpacked" && tar xzf "$BUNDLE/bundle.tgz" -C "$unpacked" &&
    BUNDLE=$unpacked
fi
if [ ! -x "$BUNDLE/cuda_test" ]; then
  echo "gpu-check: no bundle at $BUNDLE; building (needs this repo's dependencies)"
  ./scripts/gpu-bundle.sh || { echo "gpu-check: cannot build the bundle"; exit 1; }
fi
case $BUNDLE in /*) ;; *) BUNDLE=$PWD/$BUNDLE ;; esac
export LD_LIBRARY_PATH="$BUNDLE/lib:${LD_LIBRARY_PATH:-}"
[ -d "$BUNDLE/lib/ucx" ] && export UCX_MODULE_DIR="$BUNDLE/lib/ucx"  # gpu-bundle.sh's UCX modules
# cuBLAS (the GEMM MLA loads it at run time) is not carried (600 MB): the GPU machine's own, from
# its CUDA toolkit or PyTorch's wheels, after the bundle's libraries.
for d in /usr/local/cuda/lib64 \
    "$(python3 -c 'import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__) + "/lib")' 2>/dev/null)"; do
  [ -n "$d" ] && [ -d "$d" ] && LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
done
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

# record STAGE LIMIT VERDICT SECONDS NOTE: one JSON line in stages.jsonl.
record() {
  python3 -c 'import json, sys
print(json.dumps({"stage": sys.argv[1], "limit_s": int(sys.argv[2]), "verdict": sys.argv[3],
                  "seconds": int(sys.argv[4]), "note": sys.argv[5]}))' "$@" >> "$STAGES"
}
# fits STAGE LIMIT: whether STAGE, given LIMIT seconds (and the kill delay), fits what is left.
fits() {
  local left=$((BUDGET - SECONDS))
  if [ $(($2 + KILL_AFTER)) -gt "$left" ]; then
    echo "gpu-check: $1 not started: it may take ${2}s, ${left}s of the ${BUDGET}s budget left"
    record "$1" "$2" "not started" 0 "${left}s of the budget left"
    status=1
    return 1
  fi
}
bounded() {  # bounded LIMIT COMMAND...: COMMAND, killed after LIMIT (+ the kill delay) seconds
  local limit=$1
  shift
  timeout -k "$KILL_AFTER" "$limit" "$@"
}
verdict_of() {  # verdict_of RC: the word for an exit code under `bounded`
  case $1 in
    0) echo passed ;;
    124 | 137) echo "timed out" ;;
    *) echo failed ;;
  esac
}
# wanted GROUP STAGE: whether GPU_CHECK_ONLY names GROUP; if not, STAGE is recorded as skipped.
in_only() { [[ ",$ONLY," == *",$1,"* ]]; }  # in_only GROUP: whether GPU_CHECK_ONLY names it
wanted() {
  in_only "$1" && return 0
  record "$2" 0 skipped 0 "not in GPU_CHECK_ONLY"
  return 1
}
# run_tests STAGE NAME BINARY LIMIT [gtest args...]: the full log to a file first, then a
# summary; a binary that leaves no XML (it timed out or crashed) is said so, by name.
run_tests() {
  local stage=$1 name=$2 bin=$3 limit=$4
  shift 4
  fits "$stage" "$limit" || return 0
  local t0=$SECONDS
  rm -f "$OUT/$name.xml"
  bounded "$limit" "$bin" --gtest_output="xml:$OUT/$name.xml" "$@" > "$OUT/$name.log" 2>&1
  local rc=$? note=""
  grep -E '^\[  (FAILED|SKIPPED) |^\[==========\]|^\[  PASSED  \]' "$OUT/$name.log" | head -40
  if [ ! -s "$OUT/$name.xml" ]; then
    note="no XML (timed out or crashed, exit $rc): see $name.log"
    echo "gpu-check: $name: $note"
    [ $rc = 0 ] && rc=1
  fi
  [ $rc -ne 0 ] && status=1
  record "$stage" "$limit" "$(verdict_of $rc)" $((SECONDS - t0)) "$note"
}

echo "== GPU tests"
if wanted tests "GPU tests"; then
  run_tests "GPU tests" cuda_test "$BUNDLE/cuda_test" 120 --gtest_filter="$FILTER"
  run_tests "GPU tests at real dimensions" cuda_scale_test "$BUNDLE/cuda_scale_test" 120 \
    --gtest_filter="$FILTER"
  [ "$FILTER" = "*" ] &&
    run_tests "device interface on cuda:0" device_test "$BUNDLE/device_test" 45 --gtest_filter='*cuda*'
fi

echo "== failing tests one by one with CUDA_LAUNCH_BLOCKING=1 (a faulting kernel poisons its process)"
reruns=0 rerun_t0=$SECONDS rerun_failed=0 rerun_note=""
for name in cuda_test cuda_scale_test device_test; do
  in_only tests || break  # no stale results of an earlier run into this OUT
  [ -s "$OUT/$name.xml" ] || continue
  python3 - "$OUT/$name.xml" > "$OUT/$name.failed" <<'PY'
import sys, xml.etree.ElementTree as ET
for s in ET.parse(sys.argv[1]).getroot().iter("testsuite"):
    for c in s.iter("testcase"):
        if c.find("failure") is not None:
            print(f"{s.get('name')}.{c.get('name')}")
PY
  while read -r t; do
    left=$((RERUN_BUDGET - (SECONDS - rerun_t0)))
    if [ "$reruns" -ge "$MAX_RERUNS" ] || [ "$left" -lt 10 ]; then
      rerun_note="capped at $MAX_RERUNS reruns / ${RERUN_BUDGET}s; $t and later not rerun"
      break 2
    fi
    limit=$((left < 40 ? left : 40))
    fits "rerun of $t" "$limit" || break 2
    safe=$(printf '%s' "$t" | tr -c 'A-Za-z0-9_.-' '_')  # parameterised names hold '/'
    echo "-- $t"
    CUDA_LAUNCH_BLOCKING=1 bounded "$limit" "$BUNDLE/$name" --gtest_filter="$t" \
      > "$OUT/rerun.$safe.log" 2>&1
    rc=$?
    grep -E 'Failure|CUDA|error|\[  (PASSED|FAILED) ' "$OUT/rerun.$safe.log" | head -12
    reruns=$((reruns + 1))
    [ $rc -ne 0 ] && rerun_failed=$((rerun_failed + 1))
    record "rerun $t" "$limit" "$(verdict_of $rc)" 0 "rerun.$safe.log"
  done < "$OUT/$name.failed"
done
record "reruns" "$RERUN_BUDGET" "$([ $reruns = 0 ] && echo none || echo "$reruns run")" \
  $((SECONDS - rerun_t0)) "$rerun_failed still failing alone${rerun_note:+; $rerun_note}"

echo "== the SIMT kernels on the bf16 cases (stage 1 ran them on tensor cores)"
wanted simt "SIMT kernels, bf16 cases" && ATTND_CUDA_MLA=simt ATTND_CUDA_INDEXER=simt \
  run_tests "SIMT kernels, bf16 cases" cuda_test_simt "$BUNDLE/cuda_test" 60 --gtest_filter='*BF16*'

echo "== compute-sanitizer"
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
sanitize() {  # sanitize STAGE TOOL LIMIT BINARY FILTER
  local stage=$1 tool=$2 limit=$3 bin=$4 filter=$5
  fits "$stage" "$limit" || return 0
  local t0=$SECONDS log
  log="$OUT/sanitizer-$tool.log"
  bounded "$limit" "$SANITIZER" --tool "$tool" --error-exitcode 3 "$bin" \
    --gtest_filter="$filter" > "$log" 2>&1
  local rc=$?
  tail -6 "$log"
  [ $rc -ne 0 ] && status=1
  local note="$filter"
  [ $rc = 3 ] && note="$tool reported errors: sanitizer-$tool.log"
  record "$stage" "$limit" "$(verdict_of $rc)" $((SECONDS - t0)) "$note"
}
# The probe launches a real kernel (a small parity case), so a sanitizer that cannot attach to
# this GPU shows here, not as a failure of the checks below.
PROBE_FILTER='Modes/CudaParity.MatchesReferenceAndCpuBackend/token_FP32'
if ! wanted sanitizer "sanitizer probe"; then
  :
elif [ ! -x "$SANITIZER" ]; then
  echo "gpu-check: compute-sanitizer not installed: unavailable"
  record "sanitizer probe" 0 unavailable 0 "compute-sanitizer not installed"
elif fits "sanitizer probe" 30; then
  t0=$SECONDS
  bounded 30 "$SANITIZER" --tool memcheck "$BUNDLE/cuda_test" --gtest_filter="$PROBE_FILTER" \
    > "$OUT/sanitizer-probe.log" 2>&1
  rc=$?
  if grep -qiE 'not supported|unable to|no cuda-capable|device not|insufficient' \
      "$OUT/sanitizer-probe.log" || grep -q '^\[  SKIPPED \]' "$OUT/sanitizer-probe.log"; then
    echo "gpu-check: compute-sanitizer cannot check this device (sanitizer-probe.log): unavailable"
    record "sanitizer probe" 30 unavailable $((SECONDS - t0)) "$(grep -m1 -iE \
      'not supported|unable to|no cuda-capable|device not|insufficient|SKIPPED' \
      "$OUT/sanitizer-probe.log" | cut -c1-120 | tr '"' "'")"
  elif [ $rc -ne 0 ]; then
    record "sanitizer probe" 30 "$(verdict_of $rc)" $((SECONDS - t0)) "sanitizer-probe.log"
    status=1
  else
    record "sanitizer probe" 30 passed $((SECONDS - t0)) "$PROBE_FILTER"
    sanitize "memcheck, DeepSeek dims" memcheck 90 "$BUNDLE/cuda_scale_test" \
      'Heads/DeepSeekDimsTest.SimtAndTensorCoreKernelsMatchTheReferenceOverThousandsOfKeys/0'
    # The tiny-model parity cases run the SIMT kernels (their shapes are below the tensor-core
    # ones'): the races and barriers to check are in one DeepSeek-dims step through the
    # pipelined MLA, the streaming indexer and the block top-k.
    sanitize "racecheck, tensor-core step" racecheck 60 "$BUNDLE/cuda_scale_test" \
      'CudaScale.OneSmallStepThroughEveryTensorCoreKernel'
    sanitize "synccheck, tensor-core step" synccheck 45 "$BUNDLE/cuda_scale_test" \
      'CudaScale.OneSmallStepThroughEveryTensorCoreKernel'
  fi
fi

echo "== kernel benchmark"
BENCH="$BUNDLE/cuda_bench"
if ! "$BUNDLE/cuda_test" --gtest_list_tests >/dev/null 2>&1 && command -v nvcc >/dev/null; then
  # The carried binaries do not load here (e.g. an older glibc): the benchmark needs only nvcc.
  echo "gpu-check: carried binaries do not load; building cuda_bench with nvcc"
  # FlashInfer's headers are not carried: its rows are left out of this build.
  bounded 120 nvcc -O3 -std=c++17 -gencode arch=compute_80,code=sm_80 \
    -gencode arch=compute_90a,code=sm_90a -DATTND_CUDA_SM90A -DATTND_BENCH_NO_FLASHINFER -I. \
    bench/cuda_bench.cc $(ls kernels/cuda/ops/*.cu kernels/cuda/experimental/*.cu | grep -v flashinfer) kernels/cuda/backend/cublas_loader.cc \
    kernels/cuda/backend/gpu_facts.cc \
    -ldl -o "$OUT/cuda_bench" && BENCH="$OUT/cuda_bench"
fi
: > "$OUT/cuda_bench.jsonl"
if wanted bench "kernel benchmark" && fits "kernel benchmark" 90; then
  t0=$SECONDS
  bounded 90 "$BENCH" --json="$OUT/cuda_bench.jsonl" > "$OUT/cuda_bench.log" 2>&1
  rc=$?
  tail -20 "$OUT/cuda_bench.log"
  if [ $DRY = 1 ] && [ ! -s "$OUT/cuda_bench.jsonl" ]; then
    record "kernel benchmark" 90 unavailable $((SECONDS - t0)) "no GPU"
  else
    [ $rc -ne 0 ] && status=1
    record "kernel benchmark" 90 "$(verdict_of $rc)" $((SECONDS - t0)) \
      "$(wc -l < "$OUT/cuda_bench.jsonl") rows"
  fi
fi
echo "== PyTorch versions"
: > "$OUT/torch.jsonl"
if ! wanted torch "PyTorch versions"; then
  :
elif [ ! -s "$OUT/cuda_bench.jsonl" ]; then
  echo "gpu-check: nothing measured on a GPU: PyTorch versions skipped"
  record "PyTorch versions" 0 unavailable 0 "nothing measured to compare with"
elif fits "PyTorch versions" 90; then
  t0=$SECONDS
  bounded 90 python3 bench/torch_ref.py --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && echo "gpu-check: PyTorch timing failed (see $OUT/torch.log)"
  record "PyTorch versions" 90 "$(verdict_of $rc)" $((SECONDS - t0)) "torch.log"
fi
echo "== Nsight Compute on the kernels furthest from their limits"
# One launch each of the sparse MLA, the streaming indexer and the top-k slice kernel, as the
# benchmark runs them: occupancy, issue rate, stall reasons, memory throughput (ncu-KERNEL.txt).
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if ! wanted profile "profile"; then
  :
elif [ ! -s "$OUT/cuda_bench.jsonl" ]; then
  record "profile" 0 unavailable 0 "nothing measured on a GPU"
elif [ ! -x "$NCU" ]; then
  record "profile" 0 unavailable 0 "ncu not installed"
elif fits "profile" 100; then
  t0=$SECONDS
  rc=0
  # The MLA form the benchmark found fastest among those that matched SIMT (gpu_report.py
  # --fastest-mla), else the wgmma form (sm_90a; on other GPUs, or if its self-check failed, ncu
  # finds no launch of it).
  mla=$(python3 bench/gpu_report.py --fastest-mla "$OUT/cuda_bench.jsonl")
  for k in "${mla:-MlaWgmmaKernel}" IndexerStreamKernel TopKSliceKernel; do
    bounded 30 "$NCU" -k "regex:$k" -c 1 --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section SourceCounters "$BENCH" > "$OUT/ncu-$k.txt" \
      2>&1 || rc=$?
    grep -E "Duration|Achieved Occupancy|Executed Ipc Active|DRAM Throughput" "$OUT/ncu-$k.txt" |
      sed "s/^/  $k: /"
  done
  record "profile" 100 "$(verdict_of $rc)" $((SECONDS - t0)) "ncu-*.txt"
fi
echo "== end to end: attnd on the GPU, attnctl bench against it"
# The server's layer time at DeepSeek-V3.2 dims (bench/models/deepseek-v3.2-4layers.json: 128
# heads, F/S/F/S), decode batch GPU_CHECK_E2E_BATCH (64) over GPU_CHECK_E2E_CONTEXT (8192)
# tokens, on a bf16 cache with the default kernels and with the library forms
# (ATTND_CUDA_MLA=flashinfer ATTND_CUDA_TOPK=flashinfer), and on an fp8 cache: per layer the
# server's time, the round trip and the transport (e2e.jsonl; the report's end-to-end table).
# --dry-run runs the same plumbing on cpu:0 at batch 2, 300 tokens.
: > "$OUT/e2e.jsonl"
if wanted e2e "end to end" && fits "end to end" 150; then
  t0=$SECONDS
  rc=0
  if [ $DRY = 1 ]; then
    dev=cpu:0 batch=2 ctx=300 steps=1 cache_bytes=$((1 << 30))
  else
    dev=cuda:0 batch=${GPU_CHECK_E2E_BATCH:-64} ctx=${GPU_CHECK_E2E_CONTEXT:-8192} steps=3
    cache_bytes=$((16 << 30))
  fi
  for run in "bf16 default" "bf16 library" "fp8 default"; do
    read -r cache forms <<<"$run"
    forms_env=()
    [ "$forms" = library ] && forms_env=(ATTND_CUDA_MLA=flashinfer ATTND_CUDA_TOPK=flashinfer)
    log="$OUT/e2e-attnd-$cache-$forms.log"
    env "${forms_env[@]}" "$BUNDLE/attnd" --model-file=bench/models/deepseek-v3.2-4layers.json \
      --devices="$dev" --cache-dtype="$cache" --kv-cache-bytes="$cache_bytes" \
      --grpc-address=127.0.0.1 --grpc-port=0 --metrics-port=0 > "$log" 2>&1 &
    pid=$!
    target=""
    for _ in $(seq 1 100); do
      target=$(grep -oE "serving attnd.v1 on [0-9.]+:[0-9]+" "$log" | awk '{print $4}')
      [ -n "$target" ] && break
      kill -0 $pid 2>/dev/null || break
      sleep 0.1
    done
    if [ -z "$target" ]; then
      echo "gpu-check: attnd did not start ($cache $forms): $(tail -2 "$log")"
      rc=1
    else
      bounded 45 "$BUNDLE/attnctl" bench --target="$target" --batch "$batch" --context "$ctx" \
        --steps "$steps" --output json > "$OUT/e2e-$cache-$forms.json" \
        2> "$OUT/e2e-$cache-$forms.err" || rc=1
      python3 bench/gpu_report.py --e2e-line "$cache $forms" "$OUT/e2e-$cache-$forms.json" \
        >> "$OUT/e2e.jsonl" || rc=1
    fi
    kill $pid 2>/dev/null
    wait $pid 2>/dev/null
  done
  cat "$OUT/e2e.jsonl"
  if [ $DRY = 1 ]; then
    record "end to end" 150 "$([ $rc = 0 ] && echo "plumbing ok on cpu:0" || echo failed)" \
      $((SECONDS - t0)) "no GPU: cpu:0 at batch 2"
    : > "$OUT/e2e.jsonl"  # nothing measured on a GPU
  else
    [ $rc -ne 0 ] && status=1
    record "end to end" 150 "$(verdict_of $rc)" $((SECONDS - t0)) "e2e-*.json"
  fi
fi
echo "== the UCX data plane's transport on this host's CPUs"
# bench/transport_bench.py with the bundle's attnd and attnctl (a CPU attnd: the plane's bytes
# are host memory either way): per-layer transport for gRPC bytes, shared memory and UCX (sm,
# tcp) beside a bare UCX round trip, and two micro-batches in flight (transport.md). --dry-run:
# the tiny model, batch 2, one step (the plumbing).
# transport_pass STAGE LIMIT NAME [VAR=VALUE...]: bench/transport_bench.py with args[@], the
# bundle's attnd and attnctl and VAR=VALUE in its environment, into $OUT/NAME.md; recorded as STAGE.
transport_pass() {
  local stage=$1 limit=$2 name=$3 t0=$SECONDS rc=0
  shift 3
  bounded $((limit - 5)) env "$@" ATTND_BIN="$BUNDLE/attnd" ATTNCTL_BIN="$BUNDLE/attnctl" \
    python3 bench/transport_bench.py "${args[@]}" --out="$OUT/$name.md" > "$OUT/$name.log" 2>&1 ||
    rc=$?
  tail -3 "$OUT/$name.log"
  if [ $DRY = 1 ]; then
    record "$stage" "$limit" "$([ $rc = 0 ] && echo "plumbing ok" || echo failed)" \
      $((SECONDS - t0)) "no GPU needed; the dry run's tiny model at batch 2"
  else
    [ $rc -ne 0 ] && status=1
    record "$stage" "$limit" "$(verdict_of $rc)" $((SECONDS - t0)) "$name.md"
  fi
}
if wanted transport "UCX transport" && fits "UCX transport" 150; then
  if [ $DRY = 1 ]; then
    args=(--base=tiny --batches=2 --context=16 --steps=1)
  else
    args=(--batches=8,64 --context=64 --steps=20)
  fi
  transport_pass "UCX transport" 150 transport
  # Again at batch 64 with the server pushing outputs as they are built (--data-plane-push):
  # whether the push, slower than pulls on the 2-core VM where its sends and the reply share the
  # cores, wins with cores to spare (its default follows this).
  if [ $((75 + KILL_AFTER)) -le $((BUDGET - SECONDS)) ]; then
    saved=("${args[@]}")
    [ $DRY = 1 ] || args=(--batches=64 --context=64 --steps=20)
    args+=(--push=true)
    transport_pass "UCX transport, outputs pushed" 75 transport-push
    args=("${saved[@]}")
  else
    record "UCX transport, outputs pushed" 75 skipped 0 "$((BUDGET - SECONDS))s of the budget left"
  fi
  # Again at batch 64 with both sides' progress threads polling 5 ms after activity
  # (ATTND_UCX_SPIN_US=5000): what a host with cores to spare buys with a longer poll
  # (docs/data-plane.md). Only where the budget has room left; skipping it fails nothing.
  if [ $((75 + KILL_AFTER)) -le $((BUDGET - SECONDS)) ]; then
    [ $DRY = 1 ] || args=(--batches=64 --context=64 --steps=20)
    transport_pass "UCX transport, 5 ms poll" 75 transport-spin5000 ATTND_UCX_SPIN_US=5000
  else
    record "UCX transport, 5 ms poll" 75 skipped 0 "$((BUDGET - SECONDS))s of the budget left"
  fi
fi
echo "== table"
xml=()  # the test results of the groups that ran
if in_only tests; then
  xml+=("$OUT/cuda_test.xml" "$OUT/cuda_scale_test.xml")
  [ "$FILTER" = "*" ] && xml+=("$OUT/device_test.xml")
fi
in_only simt && xml+=("$OUT/cuda_test_simt.xml")
python3 bench/gpu_report.py --stages="$STAGES" --e2e="$OUT/e2e.jsonl" "$OUT/cuda_bench.jsonl" "$OUT/torch.jsonl" \
  "${xml[@]}" | tee "$OUT/table.md"
echo "gpu-check: ${SECONDS}s of the ${BUDGET}s budget"
# Everything in one file too: a device run may bring back only a few files.
tar czf "$OUT/gpu-check-logs.tgz" --exclude=gpu-check-logs.tgz -C "$OUT" . 2>/dev/null
[ $DRY = 1 ] && exit 0
exit $status
