#!/usr/bin/env bash
# Installs what is missing, builds everything (CUDA too when nvcc is present) and runs the whole
# test suite: C++ unit and integration tests (ctest) and the Python client tests (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/attnd-ccache}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)"
if [ -d client/python/tests ]; then
  python3 -m pytest -q client/python/tests
fi
