"""KV-event decoders written from the consumers' own definitions (not attnd's), for the interop
tests: vLLM's msgspec structs as vllm/distributed/kv_events.py declares them, before and after
vLLM PR #42892 (events as tagged arrays, then as tagged maps; the batch stays an array), and the
decoding rules of llm-d's kv-cache indexer (llm-d-kv-cache pkg/kvevents: the topic split at '@'
into exactly three parts, events by position or, for maps, by vLLM's field names; hashes as
uint64 from their last 8 bytes; medium lower-cased, "gpu" when absent)."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import msgpack
import msgspec

ExternalBlockHash = Union[bytes, int]


# ---- vLLM after #42892 (tagged maps) ----
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: List[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: List[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: List[Any]
    data_parallel_rank: Optional[int] = None


class KVEventBatch(EventBatch):
    events: List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


# ---- vLLM before #42892 (tagged arrays) ----
class OldKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldKVCacheEvent, tag="BlockStored"):
    block_hashes: List[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class OldBlockRemoved(OldKVCacheEvent, tag="BlockRemoved"):
    block_hashes: List[ExternalBlockHash]
    medium: Optional[str]


class OldAllBlocksCleared(OldKVCacheEvent, tag="AllBlocksCleared"):
    pass


class OldKVEventBatch(EventBatch):
    events: List[Union[OldBlockStored, OldBlockRemoved, OldAllBlocksCleared]]


OLD_DECODER = msgspec.msgpack.Decoder(type=OldKVEventBatch)


# ---- llm-d's indexer ----
LLMD_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
               "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
               "kv_cache_spec_sliding_window")
LLMD_REMOVED = ("block_hashes", "medium", "group_idx")


def llmd_topic(topic: bytes) -> Tuple[str, str]:
    """(pod, model) as llm-d splits a topic: exactly three parts at '@', else the whole topic is
    the pod and the model is empty."""
    parts = topic.decode().split("@")
    return (parts[1], parts[2]) if len(parts) == 3 else (topic.decode(), "")


def _llmd_hash(h) -> int:
    if isinstance(h, int):
        return h & (2**64 - 1)
    return int.from_bytes(bytes(h)[-8:], "big")


def llmd_decode(payload: bytes) -> List[dict]:
    """The events of one payload as llm-d's pool reads them."""
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list), "llm-d decodes the batch as an array"
    out = []
    for raw in batch[1]:
        if isinstance(raw, dict):
            tag = raw["type"]
            names = LLMD_STORED if tag == "BlockStored" else LLMD_REMOVED
            raw = [tag, *(raw.get(n) for n in (names if tag != "AllBlocksCleared" else ()))]
        tag, fields = raw[0], raw[1:]
        if tag == "BlockStored":
            assert len(fields) >= 5, "llm-d needs five fields of a BlockStored"
            out.append({"type": tag, "hashes": [_llmd_hash(h) for h in fields[0]],
                        "parent": None if fields[1] is None else _llmd_hash(fields[1]),
                        "tokens": list(fields[2]), "block_size": fields[3],
                        "medium": (fields[5] if len(fields) > 5 and fields[5] else "gpu").lower(),
                        "lora_name": fields[6] if len(fields) > 6 else None})
        elif tag == "BlockRemoved":
            assert len(fields) >= 2, "llm-d needs two fields of a BlockRemoved"
            out.append({"type": tag, "hashes": [_llmd_hash(h) for h in fields[0]],
                        "medium": (fields[1] or "gpu").lower()})
        elif tag == "AllBlocksCleared":
            out.append({"type": tag})
        else:
            raise ValueError(f"llm-d: unknown event {tag}")
    return out
