"""Rendezvous (highest-random-weight) routing of sequences to attnd replicas, with the same hash
as the C++ client (client/router.h) and the server's drain: FNV-1a 64 over the replica's name, a 0
byte, the sequence id, then a splitmix64 finaliser. Every step of a sequence must reach the
replica holding its KV cache.

Replicas are hashed by *name* (``ServerInfo.replica_name``, attnd's ``--replica-name``; in a
StatefulSet the pod's stable name), not by address, so a replica back under a new pod IP still
owns what it owned. :class:`Router` keeps a client per replica and, when a call misses
(NOT_FOUND or UNAVAILABLE on the owner), :meth:`Router.locate` finds the sequence on the
next-ranked replicas and pulls it to its owner."""

from __future__ import annotations

import socket
import threading
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import grpc

from .client import AttndClient
from .errors import AttndError
from .types import SequenceInfo

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


def rendezvous_weight(name: str, sequence_id: str) -> int:
    """The weight of ``sequence_id`` on the replica named ``name`` (a 64-bit integer)."""
    h = _fnv1a(name.encode(), 0xCBF29CE484222325)
    h = (h * 0x100000001B3) & _MASK  # the 0 byte between the two keys
    return _mix(_fnv1a(sequence_id.encode(), h))


def route(endpoints: Iterable[str], sequence_id: str) -> Optional[str]:
    """The replica name that owns ``sequence_id`` (ties to the smaller name), or None."""
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


def ranked(names: Iterable[str], sequence_id: str) -> List[str]:
    """``names`` in the order ``sequence_id`` ranks them: its owner first, then the one that owns
    it without the owner, and so on (where a drain sends it; where a miss looks next)."""
    return sorted(names, key=lambda n: (-rendezvous_weight(n, sequence_id), n))


def name_replicas(addresses: Iterable[str], **client_kwargs) -> Dict[str, str]:
    """``{name: address}``: each address with the name it serves under (``ServerInfo``; an attnd
    without one is named by its address). Unreachable addresses are left out."""
    out: Dict[str, str] = {}
    for address in addresses:
        try:
            with AttndClient(address, **client_kwargs) as c:
                out[c.info().replica_name or address] = address
        except AttndError:
            continue
    return out


_MISS = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)


class Router:
    """A client per replica (``{name: address}``) and the routing between them; thread safe.

    Step a sequence on :meth:`client_for`; when a call there fails with NOT_FOUND or UNAVAILABLE
    (a drain moved it, its owner is new, or the owner is going away), call :meth:`locate` and
    retry on the client it returns. :meth:`set_replicas` takes a new membership (re-resolve the
    Service, then :func:`name_replicas`). ``client_kwargs`` go to every :class:`AttndClient`."""

    def __init__(self, replicas: Mapping[str, str], **client_kwargs) -> None:
        self._kwargs = client_kwargs
        self._mu = threading.Lock()
        self._moving = threading.Lock()
        self._address: Dict[str, str] = {}
        self._clients: Dict[str, AttndClient] = {}
        self._retired: List[AttndClient] = []
        self._pinned: Dict[str, str] = {}  # failover(): sequence -> its new primary
        self.pulls = 0  # sequences locate() moved to their owner
        self.failovers = 0  # sequences failover() promoted
        self.set_replicas(replicas)

    def set_replicas(self, replicas: Mapping[str, str]) -> None:
        """Replaces the membership; a replica that keeps its name and address keeps its client."""
        with self._mu:
            for name in list(self._clients):
                if replicas.get(name) != self._address.get(name):
                    self._retired.append(self._clients.pop(name))  # may still be in use
            self._address = dict(replicas)

    def replicas(self) -> Dict[str, str]:
        with self._mu:
            return dict(self._address)

    def pick(self, sequence_id: str) -> Optional[str]:
        """The name of the replica that owns ``sequence_id`` (None without replicas): where
        :meth:`failover` moved it, else its rendezvous owner."""
        with self._mu:
            return self._owner(sequence_id)

    def _owner(self, sequence_id: str) -> Optional[str]:  # self._mu held
        pinned = self._pinned.get(sequence_id)
        return pinned if pinned in self._address else route(self._address, sequence_id)

    def forget(self, sequence_id: str) -> None:
        """Routes ``sequence_id`` by the hash again (after it was closed)."""
        with self._mu:
            self._pinned.pop(sequence_id, None)

    def _client(self, name: str) -> AttndClient:  # self._mu held
        c = self._clients.get(name)
        if c is None:
            c = self._clients[name] = AttndClient(self._address[name], **self._kwargs)
        return c

    def client_for(self, sequence_id: str) -> AttndClient:
        """The client of the replica that owns ``sequence_id``."""
        with self._mu:
            owner = self._owner(sequence_id)
            if owner is None:
                raise AttndError(grpc.StatusCode.UNAVAILABLE, "no replicas to route to")
            return self._client(owner)

    def locate(self, sequence_id: str) -> AttndClient:
        """Where to step ``sequence_id`` after a miss: the owner when it holds it; else the first
        next-ranked replica that does, from which it is moved to the owner (exactly as cached,
        the length confirmed, then closed there). When the owner is unreachable, or the sequence
        is in a step or still importing where it is, that replica's client. NOT_FOUND when no
        replica holds it (it may be moving: retry shortly)."""
        with self._moving:
            with self._mu:
                order = [(n, self._client(n)) for n in ranked(self._address, sequence_id)]
            if not order:
                raise AttndError(grpc.StatusCode.UNAVAILABLE, "no replicas to route to")
            owner_name, owner = order[0]
            owner_reachable = False
            try:
                owner.describe_sequence(sequence_id)
                return owner
            except AttndError as e:
                owner_reachable = e.code == grpc.StatusCode.NOT_FOUND
            for _, holder in order[1:]:
                try:
                    there = holder.describe_sequence(sequence_id)
                except AttndError:
                    continue
                if there.standby:
                    continue  # another's standby copy: failover() promotes those
                if not owner_reachable or there.in_step or there.importing:
                    return holder
                try:
                    holder.handoff(sequence_id, owner, close_source=True)
                except AttndError:
                    return holder  # the copy failed (the owner may be full): it stays usable
                self.pulls += 1
                return owner
            raise AttndError(grpc.StatusCode.NOT_FOUND,
                             f"sequence {sequence_id[:64]!r} is on none of the {len(order)} "
                             "replicas")

    def failover(self, sequence_id: str, *, generation: int, length: int,
                 failed: Optional[str] = None, standby: str = ""
                 ) -> Tuple[AttndClient, SequenceInfo]:
        """Failover (docs/replication.md): ``sequence_id``'s primary (``failed``, default: where
        this router routes it now) does not answer. Promotes its standby copy at ``generation``
        (the one the primary last reported) with the ``length`` the worker knows — on the replica
        holding the longest copy at that generation, ties broken by ``standby`` first when given
        (:attr:`SequenceInfo.standby_replica`), then by the order its rendezvous hash ranks the
        replicas without ``failed`` — and routes the sequence there from now on. Returns the new
        primary's client and the promoted sequence: its ``generation`` for the next steps, its
        ``length`` where to resume (shorter than ``length`` after an async standby's lag: resend
        the steps after it). NOT_FOUND when no replica holds a copy.

        When to call it: a call to the primary failed with UNAVAILABLE or DEADLINE_EXCEEDED (it
        is gone or unreachable), or NOT_FOUND for a sequence the worker opened there (it came
        back empty after a crash)."""
        with self._mu:
            names = ranked(self._address, sequence_id)
            if failed is None:
                failed = self._owner(sequence_id)
            if standby in names:
                names.remove(standby)
                names.insert(0, standby)
            order = [(n, self._client(n)) for n in names if n != failed]
        # The longest copy at the generation first: a copy left on a former standby may be
        # behind the one that caught up (the order above breaks ties).
        held = {}
        for name, c in order:
            try:
                there = c.describe_sequence(sequence_id)
            except AttndError:
                continue
            if there.standby and there.generation == generation:
                held[name] = there.length
        order.sort(key=lambda nc: -held.get(nc[0], -1))
        errors = []
        for name, c in order:
            try:
                info = c.promote_sequence(sequence_id, generation, length,
                                          failed_replica=failed or "")
            except AttndError as e:
                if e.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                errors.append(f"{name}: {e.details}")
                continue
            with self._mu:
                self._pinned[sequence_id] = name
                self.failovers += 1
            return c, info
        raise AttndError(grpc.StatusCode.NOT_FOUND,
                         f"no standby copy of {sequence_id[:64]!r} at generation {generation} on "
                         f"the {len(order)} other replicas: " + "; ".join(errors))

    def close(self) -> None:
        with self._mu:
            for c in list(self._clients.values()) + self._retired:
                c.close()
            self._clients.clear()
            self._retired.clear()
