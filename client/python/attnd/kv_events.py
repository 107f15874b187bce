"""KV events (docs/prefix_cache.md#kv-events): what each attnd replica's prefix cache holds, as the
replica announces it over ZeroMQ (``attnd --kv-events=tcp://*:5557``) in vLLM's KV-event schema.

A message is three frames: the topic ``kv@<replica>@<tenant>``, an 8-byte big-endian sequence
number (one per message; a missing number means events were dropped, a smaller one that the
replica restarted), and a msgpack ``EventBatch`` ``[ts, events, data_parallel_rank]`` whose rank is
the device index. Events are tagged arrays: ``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]`` and
``["AllBlocksCleared"]`` (sent at start, for the whole replica).

:func:`decode_batch` decodes one payload; :class:`BlockIndex` replays events into the set of
blocks each replica holds; :class:`KvEventSubscriber` follows replicas in a thread."""

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


def _event(raw) -> KVCacheEvent:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ValueError(f"a KV event is a tagged array, got {raw!r}")
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
    """(replica, tenant) from ``kv@<replica>@<tenant>``."""
    text = topic.decode()
    if not text.startswith("kv@") or text.count("@") < 2:
        raise ValueError(f"not an attnd KV-event topic: {text!r}")
    replica, _, tenant = text[3:].partition("@")
    return replica, tenant


class BlockIndex:
    """What each replica's prefix cache holds, replayed from its events: per (replica, tenant),
    block hash -> the devices holding it. A gap in a replica's sequence numbers marks it
    ``stale`` (its view may miss blocks or keep removed ones: ask it with LookupPrefix); a
    cleared cache or a restart (the numbers start again) empties its view. Thread safe."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._blocks: Dict[Tuple[str, str], Dict[bytes, Set[int]]] = {}
        self._last_seq: Dict[str, int] = {}
        self.stale: Set[str] = set()
        self.gaps = 0
        self.restarts = 0

    def apply(self, replica: str, tenant: str, seq: int, batch: KVEventBatch) -> None:
        with self._mu:
            last = self._last_seq.get(replica)
            if last is not None and seq <= last:  # a restarted replica counts from 0 again
                self._clear(replica)
                self.restarts += 1
            elif last is not None and seq != last + 1:
                self.gaps += 1
                self.stale.add(replica)
            self._last_seq[replica] = seq
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

    def _clear(self, replica: str) -> None:  # self._mu held
        for key in [k for k in self._blocks if k[0] == replica]:
            del self._blocks[key]
        self.stale.discard(replica)

    def forget(self, replica: str) -> None:
        """Drops a replica's view and its sequence numbers (it left, or was resynchronised)."""
        with self._mu:
            self._clear(replica)
            self._last_seq.pop(replica, None)

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
    replaying them into :attr:`index`. ``close()`` stops it."""

    def __init__(self, endpoints: Mapping[str, str], index: Optional[BlockIndex] = None) -> None:
        import zmq  # pyzmq: only a subscriber needs it

        self.index = index if index is not None else BlockIndex()
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
                self.index.apply(replica, tenant, seq, decode_batch(frames[2]))
                self.messages += 1
            except (ValueError, IndexError, TypeError) as e:
                self.errors.append(str(e))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()
        self._context.term()
