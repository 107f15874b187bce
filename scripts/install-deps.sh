#!/usr/bin/env bash
# Installs what is missing, skipping whatever is already there. Idempotent. Two profiles:
#   install-deps.sh run   what building attnd and attnctl needs (./scripts/run.sh): Debian 12
#                         packages only, no Python, nothing started.
#   install-deps.sh test  that and what the test suite needs (./scripts/test.sh, the default):
#                         GoogleTest and Benchmark, clang and libFuzzer for the sanitizer and fuzz
#                         stages, the Prometheus server and promtool (the package's service is
#                         kept from starting), iproute2, and the Python test tools in a venv
#                         cached under ~/.cache (never pip into the system Python).
# Where nvcc is, both fetch the GPU kernels' header-only libraries (scripts/fetch-gpu-libs.sh).
# `install-deps.sh test --print-venv` prints the test venv's path (made if missing) and nothing
# else.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-test}
case "$profile" in
  run | test) ;;
  *) echo "usage: $0 [run|test] [--print-venv]" >&2; exit 2 ;;
esac

# Build: attnd, attnctl and their libraries (CMakeLists.txt's find_package list; the image's
# build stage installs the same list, checked by client/python/tests/test_deploy.py).
run_pkgs=(
  build-essential cmake ninja-build ccache pkg-config
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc libabsl-dev
  prometheus-cpp-dev libcpp-httplib-dev  # /metrics: the registry, and HTTP(S) serving it
  libssl-dev libgoogle-glog-dev libcli11-dev nlohmann-json3-dev
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev
  libucx-dev  # the data plane (docs/data-plane.md): UCX 1.13, shared memory, TCP, RDMA verbs
  curl  # run.sh prints a few metrics lines
)
test_pkgs=(
  libgtest-dev libgmock-dev libbenchmark-dev clang-format openssl
  prometheus  # promtool and the server the metrics tests scrape with
  golang-go   # go: test_helm.py renders the chart with Go's text/template (deploy/helm/gorender)
  clang-14 llvm-14 libclang-rt-14-dev libfuzzer-14-dev
  iproute2  # ip netns: test_partition cuts a replica off the network
  python3-venv
)
pkgs=("${run_pkgs[@]}")
[ "$profile" = test ] && pkgs+=("${test_pkgs[@]}")
have_nvcc=0
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  have_nvcc=1
  pkgs+=(python3 python3-pip)  # fetch-gpu-libs.sh: pip download (no install) of the pinned wheels
fi

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install-deps: apt installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  # Packages with a service (Debian's prometheus) must not start it: a policy-rc.d that refuses
  # every start while apt runs (Debian's documented switch), and the unit disabled after, so
  # nothing listens on :9090 now or after a reboot. The tests start their own servers.
  policy=/usr/sbin/policy-rc.d
  made_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod 755 "$policy"
    made_policy=1
  fi
  trap '[ "$made_policy" = 1 ] && $SUDO rm -f "$policy"' EXIT
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if [[ " ${missing[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null 2>&1; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi

if [ "$profile" = test ]; then
  # The Python test tools in their own venv, made once and reused while this list is unchanged
  # (as the torch venv of test_transformers.sh).
  venv=${ATTND_TEST_VENV:-$HOME/.cache/attnd-test-venv}
  requirements="grpcio grpcio-tools grpcio-health-checking grpcio-reflection numpy pytest pytest-xdist
ml_dtypes pyyaml kubernetes-validate jsonschema ruff pyzmq msgpack msgspec"
  stamp="$venv/.attnd-requirements"
  if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$requirements" ]; then
    # Remade only if it is ours (our stamp) or absent: never a folder someone else made.
    if [ -e "$venv" ] && [ ! -f "$stamp" ] && [ -n "$(ls -A "$venv" 2>/dev/null)" ]; then
      echo "install-deps: $venv exists and is not this script's venv; set ATTND_TEST_VENV" >&2
      exit 1
    fi
    start=$(date +%s)
    rm -rf "$venv"
    python3 -m venv "$venv"
    # shellcheck disable=SC2086
    "$venv/bin/pip" install -q --disable-pip-version-check $requirements >&2
    echo "$requirements" > "$stamp"
    echo "install-deps: made $venv in $(( $(date +%s) - start )) s" >&2
  fi
  if [ "${2:-}" = --print-venv ]; then
    echo "$venv"
  fi
fi

# The GPU kernels' libraries (docs/architecture.md, "Kernels from libraries"): CUTLASS/CuTe and
# FlashInfer, header-only, from their PyPI wheels, pinned by version and sha256, unpacked (the
# headers only) into a cache outside the tree. Only where nvcc is: a CPU build needs neither.
# ATTND_GPU_LIBS_DIR moves the cache; CMake's FindCutlass/FindFlashInfer look there.
if [ "$have_nvcc" = 1 ]; then
  ./scripts/fetch-gpu-libs.sh >&2
fi
