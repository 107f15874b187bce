"""The gRPC client stub of attnd.v1.Attention, as protoc's ``attention_pb2_grpc`` names it, made
from the service's descriptor: one multicallable per RPC, unary or streaming as declared. Works
with ``grpc.Channel`` and ``grpc.aio.Channel`` alike."""

from __future__ import annotations

from . import attention_pb2
from ._descriptors import FILE, FILE_PROTO

SERVICE = FILE.services_by_name["Attention"]
_METHODS = {m.name: m for m in next(s for s in FILE_PROTO.service if s.name == "Attention").method}


class AttentionStub:
    """``stub.ServerInfo(request, timeout=...)``, ``stub.Step(request_iterator)``, ..."""

    def __init__(self, channel):
        for method in SERVICE.methods:
            proto = _METHODS[method.name]
            request = getattr(attention_pb2, method.input_type.name)
            response = getattr(attention_pb2, method.output_type.name)
            kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                    (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
                        (proto.client_streaming, proto.server_streaming)]
            setattr(self, method.name, kind(f"/{SERVICE.full_name}/{method.name}",
                                            request_serializer=request.SerializeToString,
                                            response_deserializer=response.FromString))
