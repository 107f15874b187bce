"""attnd.v1: the API of proto/attnd/v1/attention.proto — messages (:mod:`.attention_pb2`) and the
client stub (:mod:`.attention_pb2_grpc`), built at import from the descriptor compiled when the
package was built (so they match whichever protobuf runtime is installed)."""

from . import attention_pb2, attention_pb2_grpc

__all__ = ["attention_pb2", "attention_pb2_grpc"]
