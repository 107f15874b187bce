"""The messages of attnd.v1 (proto/attnd/v1/attention.proto), as protoc's ``attention_pb2`` names
them, built from the compiled descriptor for the installed protobuf runtime (see _descriptors)."""

from ._descriptors import FILE as DESCRIPTOR
from ._descriptors import message_classes

globals().update(message_classes())
__all__ = sorted(DESCRIPTOR.message_types_by_name)
