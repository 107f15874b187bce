#!/usr/bin/env bash
# Installs what is missing, builds everything (CUDA too when nvcc is present) and runs the whole
# test suite: C++ unit and integration tests (ctest), the Python client tests (pytest), the C++
# suites again under ASan+UBSan and the concurrency tests under TSan (scripts/sanitize.sh), and a
# short run of each libFuzzer target from its seed corpus (scripts/fuzz.sh).
# ATTND_QUICK=1 skips the sanitizer and fuzz stages (for a quick local loop).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/attnd-ccache}
# Paths relative to the checkout, so a fresh clone (CI) hits the same cache entries.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)"
if [ -d client/python/tests ]; then
  python3 -m pytest -q client/python/tests
fi
if [ "${ATTND_QUICK:-0}" != 1 ]; then
  ./scripts/sanitize.sh all
  ./scripts/fuzz.sh "${ATTND_FUZZ_SECONDS:-60}"
fi
