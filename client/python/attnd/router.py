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

import re
import socket
import threading
import time
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


# PromoteSequence's refusal while the primary's lease runs ("... runs 1234 ms more ...").
_LEASE_LEFT = re.compile(r"lease on this standby copy runs (\d+) ms more")


def refuses_connections(address: str, timeout_s: float = 0.2) -> bool:
    """Whether ``address`` ("host:port" or "unix:PATH") refuses a connection now: nothing listens
    there, the process is gone. False when it accepts or does not answer in ``timeout_s`` (a
    paused or cut-off replica). C++: ``client::RefusesConnections``."""
    try:
        if address.startswith("unix:"):
            with socket.socket(socket.AF_UNIX) as sk:
                sk.settimeout(timeout_s)
                sk.connect(address[len("unix:"):])
            return False
        target = address[len("dns:"):] if address.startswith("dns:") else address
        host, _, port = target.rpartition(":")
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except (OSError, ValueError):
        return False
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sk:
                sk.settimeout(timeout_s)
                sk.connect(sockaddr)
            return False
        except ConnectionRefusedError:
            continue
        except OSError:
            return False
    return bool(infos)


class Router:
    """A client per replica (``{name: address}``) and the routing between them; thread safe.

    Step a sequence on :meth:`client_for`; when a call there fails with NOT_FOUND or UNAVAILABLE
    (a drain moved it, its owner is new, or the owner is going away), call :meth:`locate` and
    retry on the client it returns. :meth:`set_replicas` takes a new membership (re-resolve the
    Service, then :func:`name_replicas`). Without a single miss: :meth:`change_replicas` with the
    worker's open sequences, then :meth:`rebalance` between their steps, which moves each to its
    new owner and routes it there from then on. ``client_kwargs`` go to every
    :class:`AttndClient`."""

    def __init__(self, replicas: Mapping[str, str], **client_kwargs) -> None:
        self._kwargs = client_kwargs
        self._mu = threading.Lock()
        self._move_mu = threading.Lock()
        self._address: Dict[str, str] = {}
        self._clients: Dict[str, AttndClient] = {}
        self._retired: List[AttndClient] = []
        self._pinned: Dict[str, str] = {}  # failover(), change_replicas(): sequence -> replica
        self._moving: Dict[str, str] = {}  # change_replicas(): sequence -> its new owner
        self._leaving: Dict[str, str] = {}  # replicas gone from the membership, still holding
        self.pulls = 0  # sequences locate() moved to their owner
        self.failovers = 0  # sequences failover() promoted
        self.rebalanced = 0  # sequences rebalance() moved
        self.set_replicas(replicas)

    def set_replicas(self, replicas: Mapping[str, str]) -> None:
        """Replaces the membership; a replica that keeps its name and address keeps its client."""
        with self._mu:
            self._set_replicas_locked(replicas)

    def _set_replicas_locked(self, replicas: Mapping[str, str]) -> None:  # self._mu held
        for name in list(self._clients):
            if replicas.get(name) != self._address.get(name) and name not in self._leaving:
                self._retired.append(self._clients.pop(name))  # may still be in use
        self._address = dict(replicas)

    def change_replicas(self, replicas: Mapping[str, str],
                        sequence_ids: Iterable[str]) -> List[str]:
        """A new membership (a replica joining or leaving) without a miss: each of
        ``sequence_ids`` (this worker's open sequences) whose owner changes stays routed where it
        is, its replica kept reachable even when it left, until :meth:`rebalance` moves it to its
        new owner. Returns those to move."""
        with self._mu:
            where = {sid: self._owner(sid) for sid in sequence_ids}
            old = dict(self._address)
            self._set_replicas_locked(replicas)
            moving = []
            for sid, now in where.items():
                if now is None or (sid in self._pinned and sid not in self._moving):
                    continue  # a failover's pin stays
                new = route(self._address, sid)
                if new == now:  # (back where it is: nothing to move)
                    self._moving.pop(sid, None)
                    self._pinned.pop(sid, None)
                    continue
                self._pinned[sid] = now
                self._moving[sid] = new
                if now not in self._address:
                    self._leaving[now] = old.get(now) or self._leaving[now]
                moving.append(sid)
            return moving

    def rebalance(self, sequence_ids: Optional[Iterable[str]] = None) -> int:
        """Moves sequences :meth:`change_replicas` kept in place (all, or those of
        ``sequence_ids``) to their new owners, exactly as cached (the sequence importer: export,
        write-only steps, the length confirmed, then closed where it was), and routes each there
        from then on. Call it between the sequences' steps. One in a step, importing, or whose
        copy failed (the new owner full) stays where it is, routed there, for a later call.
        Returns how many moved."""
        moved = 0
        with self._move_mu:
            with self._mu:
                pending = [sid for sid in (self._moving if sequence_ids is None else sequence_ids)
                           if sid in self._moving]
            for sid in pending:
                with self._mu:
                    src, dst = self._pinned[sid], self._moving[sid]
                    src_client, dst_client = self._client(src), self._client(dst)
                try:
                    there = src_client.describe_sequence(sid)
                    if there.in_step or there.importing:
                        continue
                    src_client.handoff(sid, dst_client, close_source=True)
                except AttndError as e:
                    if e.code != grpc.StatusCode.NOT_FOUND:
                        continue  # in a step meanwhile, or the copy failed: stays where it is
                    # Closed there meanwhile (by the worker, or its step was its last): nothing
                    # to move; it routes to its new owner.
                with self._mu:
                    self._moving.pop(sid, None)
                    if self._pinned.get(sid) == src:
                        del self._pinned[sid]
                    moved += 1
                    self.rebalanced += 1
            with self._mu:  # a replica that left and holds nothing of ours any more: forgotten
                held = set(self._pinned.values())
                self._leaving = {n: a for n, a in self._leaving.items() if n in held}
        return moved

    def moving(self) -> Dict[str, str]:
        """The sequences :meth:`change_replicas` kept in place: sequence -> its new owner."""
        with self._mu:
            return dict(self._moving)

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
        if pinned in self._address or pinned in self._leaving:
            return pinned
        return route(self._address, sequence_id)

    def forget(self, sequence_id: str) -> None:
        """Routes ``sequence_id`` by the hash again (after it was closed)."""
        with self._mu:
            self._pinned.pop(sequence_id, None)
            self._moving.pop(sequence_id, None)

    def _client(self, name: str) -> AttndClient:  # self._mu held
        c = self._clients.get(name)
        if c is None:
            address = self._address.get(name) or self._leaving[name]
            c = self._clients[name] = AttndClient(address, **self._kwargs)
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
        with self._move_mu:
            with self._mu:
                # Pinned (a failover, change_replicas) and missed there: the hash rules now (as
                # for any sequence, a miss on its owner locates it again).
                was = self._pinned.pop(sequence_id, None)
                self._moving.pop(sequence_id, None)
                order = [(n, self._client(n)) for n in ranked(self._address, sequence_id)]
                if was in self._leaving:  # a replica that left may still hold it
                    order.append((was, self._client(was)))
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
                stay = not owner_reachable or there.in_step or there.importing
                if not stay:
                    try:
                        holder.handoff(sequence_id, owner, close_source=True)
                    except AttndError:
                        stay = True  # the copy failed (the owner may be full): it stays usable
                if stay:
                    return holder
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
        # A primary whose address refuses connections is gone: its lease ends with it. One that
        # is paused or cut off may still serve: the copy is promoted once its lease runs out.
        with self._mu:
            failed_address = self._address.get(failed or "", "")
        def is_gone() -> bool:
            return bool(failed_address) and refuses_connections(failed_address)

        gone = is_gone()
        errors = []
        for name, c in order:
            info = None
            for _ in range(1000):
                try:
                    info = c.promote_sequence(sequence_id, generation, length,
                                              failed_replica=failed or "", release_lease=gone)
                    break
                except AttndError as e:
                    wait = _LEASE_LEFT.search(e.details or "")
                    if e.code == grpc.StatusCode.UNAVAILABLE and wait:
                        # Wait it out, looking again every 100 ms whether the primary is gone
                        # (a process killed a moment ago may still have held its port).
                        time.sleep(min(int(wait.group(1)), 100) / 1000 + 0.001)
                        gone = gone or is_gone()
                        continue
                    if e.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise
                    errors.append(f"{name}: {e.details}")
                    break
            if info is None:
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
