#!/usr/bin/env bash
# Installs what is missing for attnd and attnctl only (install-deps.sh run: Debian packages, no
# Python, no test tools, nothing started), builds Release, starts attnd on the CPU with the embedded "demo"
# model (DeepSeek-V3.2 dims: L=512, R=64, indexer 64x128, K=2048; 16 heads, 4 layers F/S/F/S),
# runs `attnctl demo` against it (chunked prefill, prefix forks, decode, float64 check), prints
# the results and stops the server.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh run
BUILD_DIR=${BUILD_DIR:-build}
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/attnd-ccache}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTND_BUILD_TESTS=OFF \
  -DATTND_BUILD_BENCH=OFF >/dev/null  # the tests' libraries are test.sh's to install
cmake --build "$BUILD_DIR" -j "$(nproc)" --target attnd attnctl

PORT=${ATTND_PORT:-50051}
METRICS_PORT=${ATTND_METRICS_PORT:-8002}
LOG=$(mktemp -t attnd.XXXXXX.log)
"$BUILD_DIR/service/attnd" --grpc-port="$PORT" --metrics-port="$METRICS_PORT" --model=demo \
  --kv-cache-bytes=$((2 << 30)) >"$LOG" 2>&1 &
PID=$!
trap 'kill -TERM $PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
  grep -q "serving attnd.v1" "$LOG" && break
  kill -0 $PID 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 0.1
done
cat "$LOG"
echo
"$BUILD_DIR/client/attnctl" info --target="localhost:$PORT"
echo
"$BUILD_DIR/client/attnctl" demo --target="localhost:$PORT" "$@"
echo
echo "metrics (http://localhost:$METRICS_PORT/metrics), a few lines:"
curl -s "localhost:$METRICS_PORT/metrics" | grep -E '^attnd_(steps_total|cache_pages|layer_seconds_count)' || true
