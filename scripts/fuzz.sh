#!/usr/bin/env bash
# Builds the libFuzzer targets (clang-14, ASan + UBSan) and runs each for SECONDS seconds
# (default 60; CI runs 30) from its committed seed corpus, printing executions and corpus size.
# Any crash, sanitizer report or failed self-check exits non-zero and leaves the reproducer in
# build-asan/ (the tree scripts/sanitize.sh builds).
#   scripts/fuzz.sh            # 60 s per target (CI: scripts/test.sh runs 30 s)
#   scripts/fuzz.sh 3600       # an hour per target
#   TARGETS=request_fuzz scripts/fuzz.sh 600
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-60}
BUILD=${FUZZ_BUILD_DIR:-build-asan}
TARGETS=${TARGETS:-"engine_ops_fuzz request_fuzz data_plane_fuzz"}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/attnd-ccache}
# Paths relative to the checkout, so a fresh clone (CI) hits the same cache entries.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
# The ASan+UBSan tree scripts/sanitize.sh builds (scripts/sanitized-tree.sh): after it, only the
# fuzz targets' own files compile here.
# shellcheck source=scripts/sanitized-tree.sh
. scripts/sanitized-tree.sh
configure_sanitized "$BUILD" address,undefined ON
cmake --build "$BUILD" -j "$(nproc)" --target $TARGETS
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# UCX's own leftovers (data_plane_fuzz; the file says which): the suppressions sanitize.sh uses.
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/tests/sanitizers/lsan.supp}
# Each target alone on a core, all at once (the same time per target as one after another).
run_one() {
  local t=$1 corpus="$BUILD/corpus/$1" log="$BUILD/$1.log" verdict=0
  mkdir -p "$corpus"
  cp -n fuzz/corpus/"$t"/* "$corpus"/ 2>/dev/null || true
  if ! "$BUILD/fuzz/$t" -max_total_time="$SECONDS_PER_TARGET" -max_len=4096 -timeout=30 \
      -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$BUILD/$t-" \
      "$corpus" >"$log" 2>&1; then
    verdict=1
    { echo "fuzz: $t FAILED; the last lines of its log:"; tail -n 40 "$log"; } > "$BUILD/$t.summary"
  else
    : > "$BUILD/$t.summary"
  fi
  local execs inputs crashes
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)
  inputs=$(find "$corpus" -type f | wc -l)
  crashes=$(find "$BUILD" -maxdepth 1 -name "$t-*" -type f | wc -l)
  echo "fuzz: $t: ${execs:-0} executions, corpus $inputs inputs, crashes: $crashes" \
    >> "$BUILD/$t.summary"
  return $verdict
}
pids=()
for t in $TARGETS; do
  echo "fuzz: $t for ${SECONDS_PER_TARGET}s (log $BUILD/$t.log)"
  run_one "$t" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for t in $TARGETS; do cat "$BUILD/$t.summary"; done
exit $status
