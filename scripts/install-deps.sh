#!/usr/bin/env bash
# Installs what attnd needs to build and test, skipping whatever is already there.
# Debian 12 packages (apt) and the Python client's packages (pip). Idempotent.
# kubernetes-validate (a 22 MB wheel carrying the Kubernetes API schemas, so the manifest test
# runs offline) adds about 10 s to a first install.
set -euo pipefail

apt_pkgs=(
  build-essential cmake ninja-build ccache pkg-config clang-format
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libabsl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  civetweb libcivetweb-dev
  prometheus
  clang-14 llvm-14 libclang-rt-14-dev libfuzzer-14-dev
  libssl-dev openssl libgoogle-glog-dev libcli11-dev nlohmann-json3-dev
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev
  iproute2  # ip netns: test_partition cuts a replica off the network
  python3-pip curl
)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install-deps: apt installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

py=${PYTHON:-python3}
if ! "$py" -c "import grpc, grpc_tools, grpc_health, grpc_reflection, numpy, pytest, ml_dtypes, yaml, kubernetes_validate, ruff, zmq, msgpack, msgspec" >/dev/null 2>&1; then
  echo "install-deps: pip installing grpcio grpcio-tools grpcio-health-checking grpcio-reflection numpy pytest ml_dtypes pyyaml kubernetes-validate ruff pyzmq msgpack msgspec"
  "$py" -m pip install -q --disable-pip-version-check grpcio grpcio-tools grpcio-health-checking grpcio-reflection numpy pytest ml_dtypes pyyaml \
    kubernetes-validate ruff pyzmq msgpack msgspec ||
    "$py" -m pip install -q --disable-pip-version-check --break-system-packages \
      grpcio grpcio-tools grpcio-health-checking grpcio-reflection numpy pytest ml_dtypes pyyaml \
      kubernetes-validate ruff pyzmq msgpack msgspec
fi

# The GPU kernels' libraries (docs/architecture.md, "Kernels from libraries"): CUTLASS/CuTe and
# FlashInfer, header-only, from their PyPI wheels, pinned by version and sha256, unpacked (the
# headers only) into a cache outside the tree. Only where nvcc is: a CPU build needs neither.
# ATTND_GPU_LIBS_DIR moves the cache; CMake's FindCutlass/FindFlashInfer look there.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  ./scripts/fetch-gpu-libs.sh
fi
