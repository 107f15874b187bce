#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries here and bundles them with the shared libraries
# they need (Debian's Abseil etc.), so they run on a GPU machine that has only the NVIDIA
# driver: build-gpu/bundle/{cuda_test,cuda_scale_test,device_test,cuda_bench,lib/}. scripts/gpu-check.sh runs
# them there.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
./scripts/install-deps.sh
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target cuda_test cuda_scale_test device_test cuda_bench
OUT=build-gpu/bundle
rm -rf "$OUT" && mkdir -p "$OUT/lib"
cp "$BUILD_DIR/tests/cuda_test" "$BUILD_DIR/tests/cuda_scale_test" "$BUILD_DIR/tests/device_test" "$BUILD_DIR/bench/cuda_bench" "$OUT/"
# Every resolved library except the C runtime and the GPU driver, which the target provides.
for bin in "$OUT/cuda_test" "$OUT/cuda_scale_test" "$OUT/device_test" "$OUT/cuda_bench"; do
  ldd "$bin" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libcuda.so*) ;;
      *) cp -L -n "$lib" "$OUT/lib/" ;;
    esac
  done
done
du -sh "$OUT"
