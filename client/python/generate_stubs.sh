#!/usr/bin/env bash
# Generates the Python gRPC stubs of attnd.v1 (client/python/attnd/v1/attention_pb2*.py, git-ignored)
# from proto/attnd/v1/attention.proto. Idempotent and quiet: does nothing when the stubs are newer
# than the proto; prints only on failure.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
proto="$root/proto/attnd/v1/attention.proto"
out="$root/client/python/attnd/v1"
py=${PYTHON:-python3}
if [ "$out/attention_pb2.py" -nt "$proto" ] && [ "$out/attention_pb2_grpc.py" -nt "$proto" ]; then
  exit 0
fi
cd "$root"
"$py" -m grpc_tools.protoc -I proto --python_out=client/python --grpc_python_out=client/python \
  proto/attnd/v1/attention.proto
