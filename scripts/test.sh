#!/usr/bin/env bash
# Installs what is missing, builds everything (CUDA too when nvcc is present) and runs the whole
# test suite: C++ unit and integration tests (ctest), the Python client tests (pytest in the test
# venv of install-deps.sh, from the checkout, then as a package pip-installed into a fresh venv, then transformers' models through
# the adapter in a torch venv cached under ~/.cache), the C++
# suites again under ASan+UBSan and the concurrency tests under TSan (scripts/sanitize.sh), and a
# short run of each libFuzzer target from its seed corpus (scripts/fuzz.sh).
# --quick (or ATTND_QUICK=1) skips the sanitizer and fuzz stages (for a quick local loop).
set -euo pipefail
if [ "${1:-}" = --quick ]; then ATTND_QUICK=1; fi
cd "$(dirname "$0")/.."
stage() { echo "test.sh: [${SECONDS}s] $*"; }  # each stage's start, for CI's stage times
stage install-deps
# The Python test tools live in a venv the install script keeps (never the system Python).
venv=$(./scripts/install-deps.sh test --print-venv)
PY="$venv/bin/python"
BUILD_DIR=${BUILD_DIR:-build}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/attnd-ccache}
# Paths relative to the checkout, so a fresh clone (CI) hits the same cache entries.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
# The transformers stage's torch venv (a CUDA build of torch from PyPI, 5.6 GB: 161 s to make on
# a fresh machine, mostly waiting on the network and the disk) is made while the build keeps the
# cores busy; a no-op once it is cached (scripts/test_transformers.sh --prepare).
torch_venv=""
if [ -d client/python/tests ]; then
  mkdir -p "$BUILD_DIR"
  setsid nice -n 10 ./scripts/test_transformers.sh --prepare >"$BUILD_DIR/torch-venv.log" 2>&1 &
  torch_venv=$!
fi
cleanup() {
  [ -z "$torch_venv" ] || kill -- -"$torch_venv" 2>/dev/null || true
  [ -z "${sanitizer_build:-}" ] || kill -- -"$sanitizer_build" 2>/dev/null || true
}
trap cleanup EXIT
stage build
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTND_BUILD_TESTS=ON \
  -DATTND_BUILD_BENCH=ON >/dev/null  # ON: a build dir run.sh configured has them OFF
cmake --build "$BUILD_DIR" -j "$(nproc)"
sanitizer_build=""
if [ "${ATTND_QUICK:-0}" != 1 ]; then
  # The sanitizer trees build meanwhile, on idle cycles only (SCHED_IDLE: a test's thread that
  # wakes takes its core back at once): the suites below mostly wait on the servers they started
  # (the e2e level used 43% of one core of two here, the Python suite 53% of two), and after a
  # header change the two trees are 500 s of compile work. Their log: $BUILD_DIR/sanitizer-build.log.
  idle=(chrt --idle 0)
  "${idle[@]}" true 2>/dev/null || idle=(nice -n 19)
  setsid "${idle[@]}" ./scripts/sanitize.sh build >"$BUILD_DIR/sanitizer-build.log" 2>&1 &
  sanitizer_build=$!
fi
stage ctest
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)"
if [ -d client/python/tests ]; then
  stage python
  "$PY" -m ruff check client/python bench/*.py examples
  # Three workers on two cores: most of these tests wait on servers they started (97 s in one
  # process here, 72 s in three).
  "$PY" -m pytest -q -n 3 client/python/tests bench/test_gpu_report.py bench/test_gpu_check.py
  stage python-data-plane
  # The layer-call suites again, every tensor on the UCX data plane (docs/data-plane.md): the
  # session server offers it and each test client connects one. (test_data_plane.py runs once,
  # above: its tests start plane servers of their own, so a second run would repeat them.)
  ATTND_TEST_DATA_PLANE=ucx "$PY" -m pytest -q -n 3 -p no:cacheprovider \
    client/python/tests/{test_client,test_client_api,test_layer_inputs,test_fp8_queries,test_lse}.py \
    client/python/tests/{test_absorption,test_shards_and_shm,test_context_parallel}.py \
    client/python/tests/test_wire_bytes.py
  stage python-package
  BUILD_DIR="$BUILD_DIR" ./scripts/test_python_package.sh
  stage transformers
  if ! wait "$torch_venv"; then
    torch_venv=""
    echo "test.sh: the torch venv was not made; the end of $BUILD_DIR/torch-venv.log:"
    tail -n 30 "$BUILD_DIR/torch-venv.log"
    exit 1
  fi
  torch_venv=""
  cat "$BUILD_DIR/torch-venv.log"
  BUILD_DIR="$BUILD_DIR" ./scripts/test_transformers.sh
fi
# With the CUDA backend built: gpu-check goes through every stage without a GPU and must say that
# nothing was measured (never a green table).
if [ -x "$BUILD_DIR/tests/cuda_test" ]; then
  BUILD_DIR="$BUILD_DIR" ./scripts/gpu-bundle.sh >/dev/null
  # python3 is the test venv's, as the GPU machine's holds numpy and grpcio (the transport
  # stages import them; with a bare system python3 their plumbing failed unseen).
  PATH="$venv/bin:$PATH" OUT="$BUILD_DIR/gpu-check-dry" ./scripts/gpu-check.sh --dry-run \
    > "$BUILD_DIR/gpu-check-dry.log" 2>&1
  tail -2 "$BUILD_DIR/gpu-check-dry.log"
  grep -q "no GPU: nothing measured" "$BUILD_DIR/gpu-check-dry.log" ||
    { echo "test.sh: gpu-check --dry-run did not end with 'nothing measured'"; exit 1; }
  for s in "UCX transport" "UCX transport, outputs pushed" "UCX transport, 5 ms poll" \
    "end to end"; do
    grep -q "\"stage\": \"$s\", .*\"verdict\": \"plumbing ok" "$BUILD_DIR/gpu-check-dry/stages.jsonl" ||
      { echo "test.sh: gpu-check --dry-run: the '$s' stage's plumbing did not run"; exit 1; }
  done
fi
if [ "${ATTND_QUICK:-0}" != 1 ]; then
  stage sanitizers
  if ! wait "$sanitizer_build"; then
    sanitizer_build=""
    echo "test.sh: the sanitizer trees did not build; the end of $BUILD_DIR/sanitizer-build.log:"
    tail -n 60 "$BUILD_DIR/sanitizer-build.log"
    exit 1
  fi
  sanitizer_build=""
  ./scripts/sanitize.sh all
  stage fuzz
  ./scripts/fuzz.sh "${ATTND_FUZZ_SECONDS:-30}"
fi
stage done
