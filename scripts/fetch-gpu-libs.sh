#!/usr/bin/env bash
# Fetches the header-only GPU libraries attnd's CUDA backend builds with, from their PyPI wheels
# (pip download --no-deps), checks each wheel's sha256 against the pin below and unpacks only its
# headers into ${ATTND_GPU_LIBS_DIR:-~/.cache/attnd/gpu-libs}/<name>-<version>/include. Nothing
# of theirs enters the tree. Idempotent: a library already unpacked (its .sha256 stamp matching)
# is left alone. CMake finds them there (cmake/FindCutlass.cmake, cmake/FindFlashInfer.cmake).
#   nvidia-cutlass    BSD-3-Clause   CUTLASS and CuTe (cute/, cutlass/)
#   flashinfer-python Apache-2.0     FlashInfer's kernels (flashinfer/), which include CUTLASS
set -euo pipefail
DIR=${ATTND_GPU_LIBS_DIR:-$HOME/.cache/attnd/gpu-libs}
py=${PYTHON:-python3}

# name version sha256 (of the wheel) path-of-the-include-folder-inside-the-wheel
LIBS=(
  "nvidia-cutlass 4.2.0.0 f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6 cutlass_library/source/include"
  "flashinfer-python 0.6.9 46d013119ecd039a5844c4847325b3571f99cdd8fd9e00839bf008c67b15811a flashinfer/data/include"
)

mkdir -p "$DIR"
for entry in "${LIBS[@]}"; do
  read -r name version sha inner <<<"$entry"
  dest="$DIR/$name-$version"
  if [ -f "$dest/.sha256" ] && [ "$(cat "$dest/.sha256")" = "$sha" ] && [ -d "$dest/include" ]; then
    continue
  fi
  echo "fetch-gpu-libs: $name==$version (headers only) into $dest"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$py" -m pip download -q --disable-pip-version-check --no-deps -d "$tmp" "$name==$version"
  wheel=$(ls "$tmp"/*.whl)
  got=$(sha256sum "$wheel" | cut -d' ' -f1)
  if [ "$got" != "$sha" ]; then
    echo "fetch-gpu-libs: $name==$version: sha256 $got, pinned $sha: refusing it" >&2
    exit 1
  fi
  rm -rf "$dest" && mkdir -p "$dest/include"
  "$py" - "$wheel" "$inner" "$dest/include" <<'PY'
import sys, zipfile, os
wheel, inner, out = sys.argv[1], sys.argv[2].rstrip("/") + "/", sys.argv[3]
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if not info.filename.startswith(inner) or info.is_dir():
            continue
        rel = info.filename[len(inner):]
        if rel.startswith("/") or ".." in rel.split("/"):
            raise SystemExit(f"unsafe path in wheel: {info.filename}")
        path = os.path.join(out, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with z.open(info) as src, open(path, "wb") as dst:
            dst.write(src.read())
PY
  printf '%s\n' "$version" >"$dest/VERSION"
  printf '%s\n' "$sha" >"$dest/.sha256"
  rm -rf "$tmp"
  trap - EXIT
done
