"""Rendezvous (highest-random-weight) routing of sequences to attnd replicas, with the same hash
as the C++ client (client/router.h): FNV-1a 64 over endpoint, a 0 byte, sequence id, then a
splitmix64 finaliser. Every step of a sequence must reach the replica holding its KV cache."""

from __future__ import annotations

import socket
from typing import Iterable, List, Optional

_MASK = (1 << 64) - 1


def _fnv1a(data: bytes, h: int) -> int:
    for c in data:
        h ^= c
        h = (h * 0x100000001B3) & _MASK
    return h


def _mix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def rendezvous_weight(endpoint: str, sequence_id: str) -> int:
    """The weight of ``sequence_id`` on ``endpoint`` (a 64-bit integer)."""
    h = _fnv1a(endpoint.encode(), 0xCBF29CE484222325)
    h = (h * 0x100000001B3) & _MASK  # the 0 byte between the two keys
    return _mix(_fnv1a(sequence_id.encode(), h))


def route(endpoints: Iterable[str], sequence_id: str) -> Optional[str]:
    """The endpoint that owns ``sequence_id`` (ties to the smaller endpoint), or None."""
    best, best_w = None, -1
    for e in endpoints:
        w = rendezvous_weight(e, sequence_id)
        if w > best_w or (w == best_w and best is not None and e < best):
            best, best_w = e, w
    return best


def resolve_endpoints(host: str, port: int) -> List[str]:
    """Every address ``host`` resolves to as "ip:port" (one per ready pod of a headless Service)."""
    out = set()
    for family, _, _, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        out.add(f"[{addr[0]}]:{port}" if family == socket.AF_INET6 else f"{addr[0]}:{port}")
    return sorted(out)
