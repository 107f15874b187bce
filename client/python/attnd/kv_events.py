"""KV events (docs/prefix_cache.md#kv-events): what each attnd replica's prefix cache holds, as the
replica announces it over ZeroMQ (``attnd --kv-events=tcp://*:5557``) in vLLM's KV-event schema.

A message is three frames: the topic ``kv@<replica>@<tenant>`` (the tenant's ``%`` and ``@``
written ``%25`` and ``%40``), an 8-byte big-endian sequence number counted per topic from the
replica's start time in microseconds (a missing number means events were dropped or the replica
restarted), and a msgpack ``EventBatch`` ``[ts, events, data_parallel_rank]`` whose rank is the
device index. Events are vLLM's tagged maps (``{"type": "BlockStored", "block_hashes": ...,
"parent_block_hash": ..., "token_ids": ..., "block_size": ..., "lora_id": ..., "medium": ...}``,
``BlockRemoved`` with ``block_hashes`` and ``medium``, ``AllBlocksCleared``) or, from an attnd
started with ``--kv-events-format=array``, the older tagged arrays ``["BlockStored", hashes,
parent, token_ids, block_size, lora_id, medium]``. ``AllBlocksCleared`` comes at start, for the
whole replica; with ``--kv-events-replay`` the replica answers vLLM's replay requests, and keeps
that announcement for a subscriber that missed it.

:func:`decode_batch` decodes one payload; :class:`BlockIndex` replays events into the set of
blocks each replica holds; :class:`KvEventSubscriber` follows replicas in a thread (filling gaps
from the replicas' replay endpoints when it knows them)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union


@dataclasses.dataclass(frozen=True)
class BlockStored:
    block_hashes: Tuple[bytes, ...]
    parent_block_hash: Optional[bytes]
    token_ids: Tuple[int, ...]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    block_hashes: Tuple[bytes, ...]
    medium: Optional[str]


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclasses.dataclass(frozen=True)
class KVEventBatch:
    ts: float
    events: Tuple[KVCacheEvent, ...]
    data_parallel_rank: Optional[int]  # attnd: the device index (None: the whole replica)


# vLLM's fields of each event in declaration order: a tagged map's fields are put in these places.
_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                           "lora_id", "medium"),
           "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}


def _event(raw) -> KVCacheEvent:
    if isinstance(raw, dict) and "type" in raw:
        tag = raw["type"]
        missing = [f for f in _FIELDS.get(tag, ())[:4] if f not in raw]
        if missing:
            raise ValueError(f"{tag} without {missing}")
        raw = [tag, *(raw.get(f) for f in _FIELDS.get(tag, ()))]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ValueError(f"a KV event is a tagged array or map, got {raw!r}")
    tag, fields = raw[0], list(raw[1:])
    if tag == "BlockStored":
        fields += [None] * (6 - len(fields))  # omitted trailing defaults
        hashes, parent, tokens, block_size, lora_id, medium = fields[:6]
        return BlockStored(tuple(hashes), parent, tuple(tokens or ()), int(block_size), lora_id,
                           medium)
    if tag == "BlockRemoved":
        fields += [None] * (2 - len(fields))
        return BlockRemoved(tuple(fields[0]), fields[1])
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event {tag!r}")


def decode_batch(payload: bytes) -> KVEventBatch:
    """One message's payload (its third frame), as vLLM's ``KVEventBatch`` decodes it."""
    import msgpack  # the kv-events extra: only a subscriber needs it

    try:
        raw = msgpack.unpackb(payload, raw=False)
    except (msgpack.UnpackException, ValueError) as e:
        raise ValueError(f"not a msgpack EventBatch: {e}") from e
    if not isinstance(raw, (list, tuple)) or len(raw) < 2:
        raise ValueError("an EventBatch is [ts, events, data_parallel_rank]")
    rank = raw[2] if len(raw) > 2 else None
    return KVEventBatch(float(raw[0]), tuple(_event(e) for e in raw[1]), rank)


def parse_topic(topic: bytes) -> Tuple[str, str]:
    """(replica, tenant) from ``kv@<replica>@<tenant>`` (the tenant's %25 and %40 decoded)."""
    text = topic.decode()
    if not text.startswith("kv@") or text.count("@") != 2:
        raise ValueError(f"not an attnd KV-event topic: {text!r}")
    replica, _, escaped = text[3:].partition("@")
    parts = escaped.split("%")
    tenant = parts[0]
    for part in parts[1:]:
        if part[:2] not in ("25", "40"):
            raise ValueError(f"a '%' not followed by 25 or 40 in {text!r}")
        tenant += ("%" if part[:2] == "25" else "@") + part[2:]
    return replica, tenant


def topic_of(replica: str, tenant: str) -> bytes:
    """The topic attnd publishes a tenant's events on."""
    return f"kv@{replica}@{tenant.replace('%', '%25').replace('@', '%40')}".encode()


END_SEQ = b"\xff" * 8  # vLLM's replay end marker: -1 as 8 signed big-endian bytes


def replay(socket, start: int, topic: bytes = b"", timeout_ms: int = 2000):
    """Asks a replica's replay endpoint (a connected zmq DEALER ``socket``) for what it still has
    from number ``start`` on (of ``topic`` only, when given), as vLLM's replay protocol asks:
    the list of (topic, seq, payload), ending at the end marker (or after ``timeout_ms`` of
    silence)."""
    socket.send_multipart([b"", start.to_bytes(8, "big")] + ([topic] if topic else []))
    out = []
    while socket.poll(timeout_ms):
        frames = socket.recv_multipart()
        if len(frames) != 4 or len(frames[2]) != 8:
            break
        if frames[1] == b"" and frames[2] == END_SEQ:
            break
        out.append((frames[1], int.from_bytes(frames[2], "big"), frames[3]))
    return out


class BlockIndex:
    """What each replica's prefix cache holds, replayed from its events: per (replica, tenant),
    block hash -> the devices holding it. Numbers are counted per topic: a gap in one marks its
    replica ``stale`` (its view may miss blocks or keep removed ones: ask it with LookupPrefix);
    a cleared cache or numbers counting back empty the replica's view and make it fresh again.
    Thread safe."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._blocks: Dict[Tuple[str, str], Dict[bytes, Set[int]]] = {}
        self._last_seq: Dict[Tuple[str, str], int] = {}  # per topic
        self.stale: Set[str] = set()
        self.gaps = 0
        self.restarts = 0

    def apply(self, replica: str, tenant: str, seq: int, batch: KVEventBatch) -> None:
        with self._mu:
            last = self._last_seq.get((replica, tenant))
            if last is not None and seq <= last:  # counting back: a restart
                self._clear(replica)
                self.restarts += 1
            elif last is not None and seq != last + 1:
                self.gaps += 1
                self.stale.add(replica)
            device = batch.data_parallel_rank
            blocks = self._blocks.setdefault((replica, tenant), {})
            for e in batch.events:
                if isinstance(e, AllBlocksCleared):
                    self._clear(replica)
                    blocks = self._blocks.setdefault((replica, tenant), {})
                elif isinstance(e, BlockStored):
                    for h in e.block_hashes:
                        blocks.setdefault(h, set()).add(device if device is not None else -1)
                else:
                    for h in e.block_hashes:
                        devices = blocks.get(h)
                        if devices is not None:
                            devices.discard(device if device is not None else -1)
                            if not devices:
                                del blocks[h]
            self._last_seq[(replica, tenant)] = seq  # after the events: a cleared one is known

    def last_seq(self, replica: str, tenant: str) -> Optional[int]:
        """The last number applied on (replica, tenant)'s topic (None: none yet, or cleared)."""
        with self._mu:
            return self._last_seq.get((replica, tenant))

    def _clear(self, replica: str) -> None:  # self._mu held
        for key in [k for k in self._blocks if k[0] == replica]:
            del self._blocks[key]
        for key in [k for k in self._last_seq if k[0] == replica]:
            del self._last_seq[key]
        self.stale.discard(replica)

    def forget(self, replica: str) -> None:
        """Drops a replica's view and its sequence numbers (it left, or was resynchronised)."""
        with self._mu:
            self._clear(replica)

    def cached_blocks(self, replica: str, tenant: str, hashes: Sequence[bytes]) -> int:
        """The leading blocks of ``hashes`` held on one device of ``replica``, as its events say
        (what its OpenSequence would map)."""
        with self._mu:
            blocks = self._blocks.get((replica, tenant), {})
            devices: Optional[Set[int]] = None
            n = 0
            for h in hashes:
                held = blocks.get(h)
                devices = set(held or ()) if devices is None else devices & (held or set())
                if not devices:
                    break
                n += 1
            return n

    def blocks(self, replica: str, tenant: str = "") -> Dict[bytes, Set[int]]:
        """A copy of one replica's view for one tenant: hash -> devices."""
        with self._mu:
            return {h: set(d) for h, d in self._blocks.get((replica, tenant), {}).items()}


class KvEventSubscriber:
    """Follows the KV events of replicas (``{replica name: "tcp://host:port"}``) in a thread,
    replaying them into :attr:`index`. With a replica's replay endpoint (``replay``, as attnd
    ``--kv-events-replay`` binds it), a gap in a topic's numbers is filled from the replica's
    buffer before the message that showed it (what the buffer no longer has leaves the replica
    stale). ``close()`` stops it."""

    def __init__(self, endpoints: Mapping[str, str], index: Optional[BlockIndex] = None,
                 replay: Optional[Mapping[str, str]] = None) -> None:
        import zmq  # pyzmq: only a subscriber needs it

        self.index = index if index is not None else BlockIndex()
        self._replay = dict(replay or {})
        self.replayed = 0
        self._zmq = zmq
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self._socket.setsockopt(zmq.RCVTIMEO, 100)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._endpoints: Dict[str, str] = {}
        self._lock = threading.Lock()
        for name, endpoint in endpoints.items():
            self.connect(name, endpoint)
        self.messages = 0
        self.errors: List[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="attnd-kv-events", daemon=True)
        self._thread.start()

    def connect(self, replica: str, endpoint: str) -> None:
        with self._lock:
            self._endpoints[replica] = endpoint
            self._socket.connect(endpoint)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._socket.recv_multipart()
            except self._zmq.Again:
                continue
            except self._zmq.ZMQError:
                return
            try:
                replica, tenant = parse_topic(frames[0])
                seq = int.from_bytes(frames[1], "big")
                batch = decode_batch(frames[2])
                last = self.index.last_seq(replica, tenant)
                if last is not None and seq > last + 1 and replica in self._replay:
                    self._fill(replica, last + 1, frames[0], seq)
                self.index.apply(replica, tenant, seq, batch)
                self.messages += 1
            except (ValueError, IndexError, TypeError) as e:
                self.errors.append(str(e))

    def _fill(self, replica: str, start: int, topic: bytes, before: int) -> None:
        """Applies what the replica's buffer still has of a topic from ``start`` (and its start's
        AllBlocksCleared, when it restarted since) up to the message numbered ``before``."""
        socket = self._context.socket(self._zmq.DEALER)
        socket.setsockopt(self._zmq.LINGER, 0)
        try:
            socket.connect(self._replay[replica])
            for t, seq, payload in replay(socket, start, topic):
                if t == topic and seq >= before:
                    continue
                r, tenant = parse_topic(t)
                last = self.index.last_seq(r, tenant)
                if last is None or seq > last:
                    self.index.apply(r, tenant, seq, decode_batch(payload))
                    self.replayed += 1
        finally:
            socket.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()
        self._context.term()
