"""The attnd.v1 API built at import time from its compiled descriptor (``attention.binpb``, a
``FileDescriptorSet`` made from proto/attnd/v1/attention.proto when the package is built).

Protoc's Python output is tied to the protobuf release that generated it: a stub made by a newer
grpcio-tools refuses an older protobuf runtime (and the reverse), so one process could not hold
attnd beside another package pinning protobuf differently. A descriptor is plain protobuf wire
data that every protobuf runtime since 3.20 reads, so the message classes made from it here always
match the installed runtime.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PROTO = "attnd/v1/attention.proto"
DESCRIPTOR_FILE = Path(__file__).with_name("attention.binpb")

_MISSING = (
    f"attnd.v1: {DESCRIPTOR_FILE} is missing. Install the package (pip install ./client/python) "
    "or, in a checkout, run client/python/generate_stubs.sh"
)


def _load() -> descriptor_pb2.FileDescriptorSet:
    try:
        data = DESCRIPTOR_FILE.read_bytes()
    except FileNotFoundError as e:
        raise ImportError(_MISSING) from e
    return descriptor_pb2.FileDescriptorSet.FromString(data)


FILE_SET = _load()
# A pool of its own: attnd's names never collide with another package's in the default pool.
POOL = descriptor_pool.DescriptorPool()
for _file in FILE_SET.file:
    POOL.Add(_file)
FILE = POOL.FindFileByName(PROTO)
FILE_PROTO = next(f for f in FILE_SET.file if f.name == PROTO)


def _message_class(desc):
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.21
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(POOL).GetPrototype(desc)  # pragma: no cover


def message_classes() -> Dict[str, type]:
    """Every top-level message of the file by name, nested types reachable as attributes."""
    out = {}

    def build(desc):
        cls = _message_class(desc)
        for nested in desc.nested_types:
            if not hasattr(cls, nested.name):
                setattr(cls, nested.name, build(nested))
        return cls

    for name, desc in FILE.message_types_by_name.items():
        out[name] = build(desc)
    return out
