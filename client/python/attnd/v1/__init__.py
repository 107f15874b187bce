"""attnd.v1: the generated protobuf/gRPC stubs of proto/attnd/v1/attention.proto.

The stubs (attention_pb2.py, attention_pb2_grpc.py) are generated, not committed. Produce them with
``client/python/generate_stubs.sh``, i.e. from the repository root::

    python3 -m grpc_tools.protoc -I proto --python_out=client/python \
        --grpc_python_out=client/python proto/attnd/v1/attention.proto
"""

_GENERATE = (
    "attnd.v1 stubs are missing: run client/python/generate_stubs.sh, i.e. from the repository "
    "root: python3 -m grpc_tools.protoc -I proto --python_out=client/python "
    "--grpc_python_out=client/python proto/attnd/v1/attention.proto"
)

import importlib

try:
    attention_pb2 = importlib.import_module(f"{__name__}.attention_pb2")
    attention_pb2_grpc = importlib.import_module(f"{__name__}.attention_pb2_grpc")
except ModuleNotFoundError as e:  # only a missing stub file; other import errors pass through
    if e.name in (f"{__name__}.attention_pb2", f"{__name__}.attention_pb2_grpc"):
        raise ImportError(_GENERATE, name=e.name) from e
    raise

__all__ = ["attention_pb2", "attention_pb2_grpc"]
