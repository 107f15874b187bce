#!/usr/bin/env bash
# The test suites under sanitizers (clang-14): the unit, engine and in-process service tests
# (ctest labels, tests/CMakeLists.txt) under ASan+UBSan, the engine's concurrency tests under
# TSan. Any report fails the run (halt_on_error). Called by scripts/test.sh; can be run alone.
#   scripts/sanitize.sh [asan|tsan|all|build]   (default all; build: both trees, no tests)
set -euo pipefail
cd "$(dirname "$0")/.."
WHICH=${1:-all}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/attnd-ccache}
# Paths relative to the checkout, so a fresh clone (CI) hits the same cache entries.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
# shellcheck source=scripts/sanitized-tree.sh
. scripts/sanitized-tree.sh
# Only the sequences' own code is ours to judge: gRPC and protobuf come uninstrumented from
# Debian, so reports whose every frame is inside them are suppressed (tests/sanitizers/).
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
build_asan() {
  configure_sanitized "$ASAN_TREE" address,undefined ON  # the fuzz targets build here too
  # The test executables of the levels run below only (not the sim level's, nor attnd, attnctl
  # or the fuzz targets: scripts/fuzz.sh builds those it runs).
  cmake --build "$ASAN_TREE" -j "$(nproc)" --target attnd_tests_unit attnd_tests_engine \
    attnd_tests_service
}
build_tsan() {
  configure_sanitized build-tsan thread
  cmake --build build-tsan -j "$(nproc)" --target engine_state_test engine_hardening_test \
    engine_devices_test engine_concurrency_test service_concurrency_test thread_pool_test \
    engine_tiers_test tier_store_test ucx_plane_test
}
if [ "$WHICH" = build ]; then  # scripts/test.sh builds them while the plain suites run
  build_asan
  build_tsan
  exit 0
fi
if [ "$WHICH" = asan ] || [ "$WHICH" = all ]; then
  build_asan
  echo "sanitize: ASan+UBSan: the unit, engine and service levels (e2e and sim run in the plain ctest)"
  # Not here: the sim level (lane-level simulations of the CUDA kernels: test code only, and the
  # simulator bounds-checks every shared and global access itself; 48 s of test time here), and
  # two long tests whose paths others cover under ASan: EngineHardening's begin-after-abort race
  # (25 s; it runs under TSan below) and Fp8Cache's end-to-end error measurement (20 s; the fp8 cache's
  # steps run here in Fp8Cache/DeviceInterface and PerIsa's fp8-cache decode). The CI budget after a header change needed the room.
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:suppressions=$PWD/tests/sanitizers/asan.supp \
  LSAN_OPTIONS=suppressions=$PWD/tests/sanitizers/lsan.supp \
    ctest --test-dir "$ASAN_TREE" --output-on-failure -j "$(nproc)" -LE 'e2e|sim' \
      -E 'Cuda|ABeginRightAfterAnAbortOfARunningLayerSucceeds|EndToEndErrorAgainstAnUnquantisedCacheIsMeasured'
fi
if [ "$WHICH" = tsan ] || [ "$WHICH" = all ]; then
  # The engine's concurrency (layers of different steps at once, aborts racing running layers,
  # BeginStep waiting for an abort, several devices, tier moves racing steps) and the service's, in-process (steps from
  # many threads, sharded steps gathered across threads, shared-memory regions changing under
  # running layers), and the UCX data plane's progress thread against its callers (in-process, the
  # two ends of a plane; UCX's own code is uninstrumented). The tests through a gRPC server are not run under TSan: Debian's gRPC and
  # Abseil are uninstrumented, so every reactor handed between gRPC's threads and ours reads as
  # a race (false reports); an instrumented gRPC is not packaged.
  build_tsan
  echo "sanitize: TSan: the engine's and the service's concurrency tests, the data plane's threads"
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/sanitizers/tsan.supp" \
    ctest --test-dir build-tsan --output-on-failure -j 1 -R 'EngineState|EngineHardening|EngineDevices|EngineConcurrency|ServiceConcurrency|ThreadPool|Tiers|DiskTier|UcxPlane|UcxPush|UcxKeepalive'
fi
