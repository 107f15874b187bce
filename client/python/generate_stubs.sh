#!/usr/bin/env bash
# Compiles proto/attnd/v1/attention.proto into client/python/attnd/v1/attention.binpb (a
# FileDescriptorSet, git-ignored) for running the client from a checkout; `pip install
# ./client/python` does the same when it builds the package. Idempotent and quiet: does nothing
# when the descriptor is newer than the proto; prints only on failure.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
proto="$root/proto/attnd/v1/attention.proto"
out="$root/client/python/attnd/v1/attention.binpb"
py=${PYTHON:-python3}
if [ "$out" -nt "$proto" ]; then
  exit 0
fi
cd "$root"
"$py" -m grpc_tools.protoc -I proto --include_imports --descriptor_set_out="$out" \
  proto/attnd/v1/attention.proto
