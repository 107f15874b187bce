"""Prefix-aware routing (docs/prefix_cache.md#routing): a new sequence goes to the replica whose
prefix cache holds the longest run of its prompt's blocks, as the replicas' KV events say
(:mod:`attnd.kv_events`), so the worker prefills only what no replica holds. Nothing cached
anywhere (or nothing known yet), or equal runs: the replica with the most room (free and cache-only
pages; a ``load`` callable may add open steps) wins, then the rendezvous hash of the sequence id
(the :class:`attnd.Router` rule). A replica whose events had a gap is asked directly (LookupPrefix)
until it restarts; one that restarted starts from an empty view. The choice is remembered: every
later step of the sequence goes to the same replica (:meth:`PrefixRouter.client_for`)."""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

from .block_hash import hash_blocks
from .client import AttndClient
from .errors import AttndError
from .kv_events import BlockIndex, KvEventSubscriber
from .router import rendezvous_weight

# (room, open steps): more room first, then fewer open steps (the default, from ServerInfo, knows
# no open steps: 0).
Load = Tuple[int, int]


class PrefixRouter:
    """Routes new sequences among ``replicas`` ({name: address}) by their cached prefix.

    ``kv_events`` ({name: ZeroMQ endpoint}, ``ServerInfo.prefix_cache.kv_events``) starts a
    subscriber; without it, or for a replica without an endpoint, every choice asks the
    replicas (LookupPrefix). ``block_size`` and ``salt`` must be the servers' page size and the
    workers' salt (:func:`attnd.hash_blocks`). ``load`` ({name: (room, open_steps)}) replaces the
    default (each replica's ServerInfo, at most every ``load_ttl_s``). ``kv_replay`` ({name:
    ZeroMQ endpoint}, ``ServerInfo.prefix_cache.kv_events_replay``) fills gaps in the events."""

    def __init__(self, replicas: Mapping[str, str], kv_events: Optional[Mapping[str, str]] = None,
                 *, block_size: int, salt: bytes = b"", tenant: str = "",
                 load: Optional[Callable[[str], Load]] = None, load_ttl_s: float = 0.5,
                 kv_replay: Optional[Mapping[str, str]] = None, **client_kwargs) -> None:
        self._replicas = dict(replicas)
        self._client_kwargs = client_kwargs
        self._clients: Dict[str, AttndClient] = {}
        self._mu = threading.Lock()
        self.block_size = int(block_size)
        self.salt = bytes(salt)
        self.tenant = tenant
        self.index = BlockIndex()
        self._subscriber = (KvEventSubscriber(kv_events, self.index, kv_replay)
                            if kv_events else None)
        self._events = set(kv_events or ())
        self._load = load
        self._load_ttl = load_ttl_s
        self._loads: Dict[str, Tuple[float, Load]] = {}
        self._owner: Dict[str, str] = {}

    def client(self, name: str) -> AttndClient:
        with self._mu:
            c = self._clients.get(name)
            if c is None:
                c = self._clients[name] = AttndClient(self._replicas[name],
                                                      **self._client_kwargs)
            return c

    def hashes(self, token_ids: Optional[Sequence[int]] = None,
               block_hashes: Optional[Sequence[bytes]] = None) -> Sequence[bytes]:
        if block_hashes is not None:
            return list(block_hashes)
        return hash_blocks(list(token_ids or []), self.block_size, self.salt)

    def cached_blocks(self, name: str, hashes: Sequence[bytes]) -> int:
        """The leading blocks of ``hashes`` replica ``name`` holds: from its events, or (no
        events, or a gap in them) by asking it."""
        if name in self._events and name not in self.index.stale:
            return self.index.cached_blocks(name, self.tenant, hashes)
        try:
            return self.client(name).lookup_prefix(block_hashes=hashes).cached_blocks
        except AttndError:
            return 0

    def load(self, name: str) -> Load:
        if self._load is not None:
            return self._load(name)
        now = time.monotonic()
        cached = self._loads.get(name)
        if cached is not None and now - cached[0] < self._load_ttl:
            return cached[1]
        try:
            info = self.client(name).info()
            room = sum(d.pages_free + d.pages_cached for d in info.devices)
            value = (room, 0)
        except AttndError:
            value = (-1, 0)
        self._loads[name] = (now, value)
        return value

    def choose(self, sequence_id: str, token_ids: Optional[Sequence[int]] = None,
               block_hashes: Optional[Sequence[bytes]] = None) -> Tuple[str, int]:
        """The replica for a new sequence and the blocks it is expected to find there; the
        sequence is then remembered as that replica's."""
        hashes = self.hashes(token_ids, block_hashes)
        best: Optional[Tuple[int, Load, int, str]] = None
        for name in self._replicas:
            n = self.cached_blocks(name, hashes) if hashes else 0
            room, steps = self.load(name)
            key = (n, (room, -steps), rendezvous_weight(name, sequence_id), name)
            if best is None or key[:3] > best[:3]:
                best = key
        assert best is not None, "no replicas"
        with self._mu:
            self._owner[sequence_id] = best[3]
        return best[3], best[0]

    def client_for(self, sequence_id: str) -> AttndClient:
        """The client of the replica chosen for ``sequence_id`` (KeyError if never chosen)."""
        with self._mu:
            name = self._owner[sequence_id]
        return self.client(name)

    def forget(self, sequence_id: str) -> None:
        with self._mu:
            self._owner.pop(sequence_id, None)

    def close(self) -> None:
        if self._subscriber is not None:
            self._subscriber.close()
        with self._mu:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
