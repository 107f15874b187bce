"""Prefix-aware routing (docs/prefix_cache.md#routing): a new sequence goes to the replica that
scores best on what it holds of the prompt against how busy it is, as llm-d's weighted scorers
do: ``cache`` × the fraction of the prompt's blocks it holds (its KV events say, or it is asked),
plus ``free`` × the fraction of its device pages free, minus ``load`` × its open steps and queued
calls against the busiest replica's (:class:`PrefixWeights`; the defaults are the bench's,
bench/results/prefix.md). A replica that does not answer is chosen last; equal scores go to the
rendezvous owner of the sequence id (the :class:`attnd.Router` rule). The C++ client's
``client::ChoosePrefixReplica`` computes the same scores. A replica whose events had a gap is asked
directly (LookupPrefix) until it restarts; one that restarted starts from an empty view. The
choice is remembered: every later step of the sequence goes to the same replica
(:meth:`PrefixRouter.client_for`)."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from .block_hash import hash_blocks
from .client import AttndClient
from .errors import AttndError
from .kv_events import BlockIndex, KvEventSubscriber
from .router import rendezvous_weight


@dataclasses.dataclass(frozen=True)
class PrefixWeights:
    """How :func:`score_replicas` weighs a replica (docs/prefix_cache.md#routing)."""
    cache: float = 1.0  # × the fraction of the prompt's blocks it holds
    free: float = 2.0  # × the fraction of its device pages free (not even cache-only)
    load: float = 0.5  # × its open steps + queued calls / (the busiest replica's + 1)


class ReplicaLoad(NamedTuple):
    """A replica's room and work (ServerInfo: devices' pages_free and pages_total, load's
    open_steps + queue_depth); ``free_pages`` -1: it did not answer."""
    free_pages: int
    total_pages: int
    busy: int = 0


def score_replicas(candidates: Sequence[Tuple[str, int, ReplicaLoad]], prompt_blocks: int,
                   sequence_id: str, weights: PrefixWeights = PrefixWeights()) -> str:
    """The replica for a new sequence among ``candidates`` ((name, cached blocks, load)): the
    best score, equal scores to the higher rendezvous weight (then the smaller name); a replica
    that did not answer only when none did. The arithmetic is client::ChoosePrefixReplica's, in
    the same order, so both clients choose alike."""
    if not candidates:
        raise ValueError("no replicas")
    blocks = max([prompt_blocks, 1] + [c for _, c, _ in candidates])
    busiest = max([ld.busy for _, _, ld in candidates if ld.free_pages >= 0] + [0])
    best = None
    for name, cached, ld in candidates:
        up = ld.free_pages >= 0
        score = weights.cache * (cached / blocks)
        if up and ld.total_pages > 0:
            score += weights.free * (ld.free_pages / ld.total_pages)
        if up:
            score -= weights.load * (ld.busy / (busiest + 1))
        key = (up, score, rendezvous_weight(name, sequence_id))
        if best is None or key > best[0] or (key == best[0] and name < best[1]):
            best = (key, name)
    return best[1]


class PrefixRouter:
    """Routes new sequences among ``replicas`` ({name: address}) by their cached prefix.

    ``kv_events`` ({name: ZeroMQ endpoint}, ``ServerInfo.prefix_cache.kv_events``) starts a
    subscriber; without it, or for a replica without an endpoint, every choice asks the
    replicas (LookupPrefix). ``block_size`` and ``salt`` must be the servers' page size and the
    workers' salt (:func:`attnd.hash_blocks`). ``load`` (name -> :class:`ReplicaLoad`) replaces
    the default: each replica's ServerInfo, at most every ``load_ttl_s``, with the pages of the
    prompts routed to it since taken off its free pages (an older ``load`` returning (room,
    open steps) is read as room with no free-room term). ``weights``: :class:`PrefixWeights`.
    ``kv_replay`` ({name: ZeroMQ endpoint}, ``ServerInfo.prefix_cache.kv_events_replay``) fills
    gaps in the events."""

    def __init__(self, replicas: Mapping[str, str], kv_events: Optional[Mapping[str, str]] = None,
                 *, block_size: int, salt: bytes = b"", tenant: str = "",
                 load: Optional[Callable[[str], Union[ReplicaLoad, Tuple[int, int]]]] = None,
                 load_ttl_s: float = 0.5, weights: PrefixWeights = PrefixWeights(),
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
        self.weights = weights
        self._loads: Dict[str, Tuple[float, ReplicaLoad]] = {}
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

    def load(self, name: str) -> ReplicaLoad:
        if self._load is not None:
            got = self._load(name)
            if len(got) == 2:  # an older callable's (room, open steps)
                return ReplicaLoad(got[0], 0, got[1]) if got[0] >= 0 else ReplicaLoad(-1, 0)
            return ReplicaLoad(*got)
        now = time.monotonic()
        with self._mu:
            cached = self._loads.get(name)
        if cached is not None and now - cached[0] < self._load_ttl:
            return cached[1]
        try:
            info = self.client(name).info()
            busy = info.load.open_steps + info.load.queue_depth if info.load else 0
            value = ReplicaLoad(sum(d.pages_free for d in info.devices),
                                sum(d.pages_total for d in info.devices), busy)
        except AttndError:
            value = ReplicaLoad(-1, 0)
        with self._mu:
            self._loads[name] = (now, value)
        return value

    def choose(self, sequence_id: str, token_ids: Optional[Sequence[int]] = None,
               block_hashes: Optional[Sequence[bytes]] = None) -> Tuple[str, int]:
        """The replica for a new sequence (:func:`score_replicas`) and the blocks it is expected
        to find there; the sequence is then remembered as that replica's."""
        hashes = self.hashes(token_ids, block_hashes)
        candidates = [(name, self.cached_blocks(name, hashes) if hashes else 0, self.load(name))
                      for name in self._replicas]
        prompt_blocks = len(hashes)
        if token_ids is not None:
            prompt_blocks = -(-len(token_ids) // self.block_size)
        name = score_replicas(candidates, prompt_blocks, sequence_id, self.weights)
        cached = next(c for n, c, _ in candidates if n == name)
        with self._mu:
            self._owner[sequence_id] = name
            # Until the next ServerInfo: the pages this prompt will take are no longer free.
            seen = self._loads.get(name)
            if seen is not None and seen[1].free_pages >= 0:
                ld = seen[1]
                self._loads[name] = (seen[0], ld._replace(
                    free_pages=max(0, ld.free_pages - max(0, prompt_blocks - cached))))
        return name, cached

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
