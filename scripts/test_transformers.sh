#!/usr/bin/env bash
# transformers' DeepSeek-V3.2 and GLM-MoE-DSA models served through attnd
# (client/python/tests/test_transformers.py) in a venv cached under ~/.cache, as ccache is:
# torch from PyPI is a CUDA build of about 5.6 GB installed, so the venv is made once (about 3
# minutes on the CI machine) and reused while its requirement list is unchanged. Needs the built
# attnd, except with --prepare (makes the venv only: scripts/test.sh runs it during the build).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
venv=${ATTND_TORCH_VENV:-$HOME/.cache/attnd-torch-venv}
requirements="torch transformers numpy grpcio grpcio-tools ml_dtypes pytest"
stamp="$venv/.attnd-requirements"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$requirements" ]; then
  start=$(date +%s)
  rm -rf "$venv"
  python3 -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/pip" install -q --disable-pip-version-check $requirements
  echo "$requirements" > "$stamp"
  echo "test_transformers: made $venv in $(( $(date +%s) - start )) s ($(du -sh "$venv" | cut -f1))"
fi
if [ "${1:-}" = --prepare ]; then exit 0; fi
ATTND_REQUIRE_TORCH=1 ATTND_BIN="$PWD/$BUILD_DIR/service/attnd" "$venv/bin/python" -m pytest -q \
  -p no:cacheprovider client/python/tests/test_transformers.py
