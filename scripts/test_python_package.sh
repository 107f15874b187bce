#!/usr/bin/env bash
# The Python package as a user gets it: a fresh venv, `pip install ./client/python` beside
# tritonclient[grpc] (which pins its own protobuf), then the package's tests against a live attnd
# with the checkout kept off sys.path (ATTND_TEST_INSTALLED=1); then the same from an sdist (which
# carries the proto). Needs the built attnd.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
venv="$BUILD_DIR/pkg-venv"
rm -rf "$venv"
python3 -m venv "$venv"
start=$(date +%s)
"$venv/bin/pip" install -q --disable-pip-version-check ./client/python "tritonclient[grpc]" pytest
echo "test_python_package: fresh venv + pip install in $(( $(date +%s) - start )) s"
rm -rf client/python/build client/python/attnd.egg-info  # setuptools' in-tree build leftovers
ATTND_TEST_INSTALLED=1 ATTND_BIN="$PWD/$BUILD_DIR/service/attnd" "$venv/bin/python" -m pytest -q \
  -p no:cacheprovider client/python/tests/test_package.py client/python/tests/test_client.py \
  client/python/tests/test_block_hash.py \
  client/python/tests/test_router.py
# An sdist (as a package index would serve it) builds and installs away from the checkout.
py="$(cd "$venv/bin" && pwd)/python"
sdist_dir="$(mkdir -p "$BUILD_DIR/pkg-sdist" && cd "$BUILD_DIR/pkg-sdist" && pwd)"
rm -f "$sdist_dir"/attnd-*.tar.gz
(cd client/python && "$py" setup.py -q sdist -d "$sdist_dir" 2>/dev/null)
rm -rf client/python/build client/python/attnd.egg-info
(cd /tmp && "$py" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall \
  "$sdist_dir"/attnd-*.tar.gz)
ATTND_TEST_INSTALLED=1 ATTND_BIN="$PWD/$BUILD_DIR/service/attnd" "$py" -m pytest -q \
  -p no:cacheprovider client/python/tests/test_package.py
