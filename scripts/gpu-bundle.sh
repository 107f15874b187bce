#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries here and bundles them with the shared libraries
# they need (Debian's Abseil etc.), so they run on a GPU machine that has only the NVIDIA
# driver: build-gpu/bundle/{cuda_test,cuda_scale_test,device_test,cuda_bench,attnd,attnctl,lib/}
# (attnd and attnctl for gpu-check's end-to-end stage).
# scripts/gpu-check.sh runs them there. Says the bundle's size and fails when it and the tracked
# tree exceed the 64 MiB a device run carries.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
./scripts/install-deps.sh test >/dev/null
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTND_BUILD_TESTS=ON \
  -DATTND_BUILD_BENCH=ON >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target cuda_test cuda_scale_test device_test cuda_bench \
  attnd attnctl
# The files in build-gpu/bundle-files; what a device run carries is build-gpu/bundle/bundle.tgz
# (gzip: the binaries' device code makes 67 MB, 23 compressed), which gpu-check unpacks there.
OUT=build-gpu/bundle-files
rm -rf "$OUT" && mkdir -p "$OUT/lib"
cp "$BUILD_DIR/tests/cuda_test" "$BUILD_DIR/tests/cuda_scale_test" "$BUILD_DIR/tests/device_test" \
  "$BUILD_DIR/bench/cuda_bench" "$BUILD_DIR/service/attnd" "$BUILD_DIR/client/attnctl" "$OUT/"
# Every resolved library except the C runtime and the GPU driver, which the target provides.
for bin in "$OUT/cuda_test" "$OUT/cuda_scale_test" "$OUT/device_test" "$OUT/cuda_bench" \
  "$OUT/attnd" "$OUT/attnctl"; do
  ldd "$bin" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libcuda.so*) ;;
      *) cp -L -n "$lib" "$OUT/lib/" ;;
    esac
  done
done
# UCX loads its transport modules at run time from ucx/ beside libucs (ldd does not list them):
# cma, the single-copy shared-memory one, travels (gpu-check's transport stage points
# UCX_MODULE_DIR at it); the RDMA modules would need libraries the GPU machine may not have.
ucs=$(ldd "$OUT/attnd" | awk '/libucs\.so/ {print $3}')
if [ -n "$ucs" ] && [ -d "$(dirname "$ucs")/ucx" ]; then
  mkdir -p "$OUT/lib/ucx"
  cp -L "$(dirname "$ucs")"/ucx/libuct_cma.so.0 "$OUT/lib/ucx/" 2>/dev/null || true
fi
# Debug sections are most of the bytes; function names stay for backtraces.
strip --strip-debug "$OUT"/cuda_test "$OUT"/cuda_scale_test "$OUT"/device_test "$OUT"/cuda_bench \
  "$OUT"/attnd "$OUT"/attnctl \
  "$OUT"/lib/* 2>/dev/null || true
CARRY=build-gpu/bundle
rm -rf "$CARRY" && mkdir -p "$CARRY"
tar czf "$CARRY/bundle.tgz" -C "$OUT" .
# A device run carries the working tree and the bundle, 64 MiB in all.
LIMIT=$((64 << 20))
bundle=$(du -sb "$CARRY" | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "gpu-bundle: $CARRY $((bundle >> 20)) MiB + the tracked tree $((tree >> 20)) MiB =" \
  "$(((bundle + tree) >> 20)) MiB of the $((LIMIT >> 20)) MiB a device run can carry"
if [ $((bundle + tree)) -gt "$LIMIT" ]; then
  echo "gpu-bundle: too large to carry to the GPU machine"
  exit 1
fi
