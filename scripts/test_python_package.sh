#!/usr/bin/env bash
# The Python package as a user gets it: a fresh venv, `pip install ./client/python` beside
# tritonclient[grpc] (which pins its own protobuf), then the package's tests against a live attnd
# with the checkout kept off sys.path (ATTND_TEST_INSTALLED=1). Needs the built attnd.
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
  client/python/tests/test_router.py
