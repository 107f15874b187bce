"""The plain data the client hands back: the server's description (:class:`ServerInfo`,
:class:`ModelSpec`, ...), sequences and steps, a layer call's details (:class:`LayerResult`) and a
context-parallel layer's candidates (:class:`Candidates`)."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .v1 import attention_pb2 as pb

__all__ = ["AbsorptionInfo", "Batch", "Candidates", "DeviceInfo", "LayerResult", "ModelSpec",
           "SequenceInfo", "ServerInfo", "StepInfo"]

#: A step's batch: (sequence_id, q_len) pairs; tensors hold sum(q_len) rows in this order.
Batch = Sequence[Tuple[str, int]]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The served model (see ModelSpec in attention.proto)."""

    name: str
    layers: Tuple[str, ...]  # per layer: "full", "shared" or "dense"
    kv_lora_rank: int  # L
    qk_rope_head_dim: int  # R
    num_heads: int  # H
    index_n_heads: int  # Hi
    index_head_dim: int  # Di
    index_topk: int  # K
    page_size: int
    sm_scale: float
    max_context: int
    selection: str  # "token", "page_union" or "page_budget:B"
    page_union_max_pages: int
    prefill: str  # "sparse" or "dense"
    sliding_window: int
    soft_cap: float

    @property
    def num_layers(self) -> int:
        return len(self.layers)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    name: str
    pages_total: int
    pages_free: int
    bytes_per_page: int
    sequences: int
    # of the pages in use, those only the prefix cache holds (a request needing room takes them)
    pages_cached: int = 0


@dataclasses.dataclass(frozen=True)
class PrefixCacheInfo:
    max_cached_bytes: int  # --prefix-cache-bytes; -1: as much as the tiers hold
    blocks: int  # indexed now, every tenant
    cached_only_pages: int  # pages only the cache holds
    kv_events: str  # the KV-event endpoint ("" = off)
    kv_events_replay: str = ""  # its replay endpoint ("" = off)
    kv_events_format: str = ""  # "map" (vLLM's tagged maps) or "array"


@dataclasses.dataclass(frozen=True)
class ReplicationInfo:
    """Standby replicas (docs/replication.md)."""
    mode: str  # "off", "async" or "sync"
    peers: Tuple[str, ...]  # the standby peers by replica name, as resolved so far
    max_lag_steps: int  # async: commits wait beyond this lag
    standby_sequences: int  # standby copies held here
    standby_pages: int
    standby_budget_pages: int  # -1: no limit


@dataclasses.dataclass(frozen=True)
class LoadInfo:
    """The work in flight on a server now (what :class:`attnd.PrefixRouter` weighs)."""
    open_steps: int  # steps begun and not yet committed or aborted
    queue_depth: int  # calls waiting for an executor thread
    sequences: int  # open sequences, standby copies included


@dataclasses.dataclass(frozen=True)
class PrefixLookup:
    cached_blocks: int  # leading blocks held on one device, any tier
    cached_tokens: int
    device: str  # "" when none
    device_blocks: int  # of them, on the device tier
    block_size: int


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    version: str
    model: ModelSpec
    backend: str
    cpu_isa: str
    cache_datatype: str  # "BF16", "FP32" or "FP8_E4M3"
    devices: Tuple[DeviceInfo, ...]
    datatypes: Tuple[str, ...]
    max_message_bytes: int
    step_idle_timeout_ms: int
    tenant: str  # who this client is authenticated as ("" = the anonymous tenant)
    admin: bool  # the admin identity
    auth: str  # "none", "token" or "mtls"
    shm: bool  # shared memory is enabled (over the server's Unix-socket listener)
    max_attended_positions: int  # attend_layer(attended=True): the step's visible keys, at most
    # server-side absorption's weights (None: the server holds none and refuses q_nope)
    absorption: Optional[AbsorptionInfo] = None
    # serves context-parallel steps (False on servers too old to know them: never drive one)
    context_parallel: bool = False
    # the name clients and drains hash sequences over (attnd --replica-name; "" from older ones)
    replica_name: str = ""
    # the tiers below the devices, host then disk (pages_total 0: off; empty from older servers)
    tiers: Tuple[TierInfo, ...] = ()
    # the prefix cache (None from servers without one)
    prefix_cache: Optional[PrefixCacheInfo] = None
    # standby replicas (None from servers without them)
    replication: Optional[ReplicationInfo] = None
    # the work in flight (None from servers too old to say)
    load: Optional[LoadInfo] = None


@dataclasses.dataclass(frozen=True)
class TierInfo:
    """A tier below the devices (``ServerInfo.tiers``; docs/architecture.md#tiers)."""

    name: str  # "host" (--host-cache-bytes) or "disk" (--disk-cache-dir)
    pages_total: int  # 0: the tier is off
    pages_used: int
    bytes_per_page: int
    sequences: int  # sequences spilled to this tier


@dataclasses.dataclass(frozen=True)
class AbsorptionInfo:
    """Server-side absorption (``ServerInfo.absorption``): layer calls may send q_nope
    [T, H, qk_nope_head_dim] and receive [T, H, v_head_dim]."""

    qk_nope_head_dim: int
    v_head_dim: int
    source: str  # "checkpoint DIR" or "upload"
    bytes: int  # host memory the weights take


@dataclasses.dataclass(frozen=True)
class SequenceInfo:
    sequence_id: str
    length: int  # committed tokens
    device: str
    num_pages: int
    in_step: bool
    tenant: str  # set in the admin's every-tenant listing
    importing: bool  # a handoff target not yet holding every token
    # where its pages are: "device", or spilled to "host" or "disk" (a step restores it first);
    # "" from servers without tiers
    tier: str = ""
    moving: bool = False  # between tiers now
    lost: bool = False  # a page could not be read back from disk: every use but close fails
    # open_sequence with a prompt: the tokens found in the prefix cache (prefill from there)
    cached_tokens: int = 0
    # standby replicas (docs/replication.md): promotions + 1 (steps may name it), whether this
    # is a standby copy, and on a primary the replica holding its standby ("" when none)
    generation: int = 0
    standby: bool = False
    standby_replica: str = ""


@dataclasses.dataclass(frozen=True)
class StepInfo:
    step_id: int
    num_tokens: int  # T = sum(q_len)


def _plain(cls, msg, **override):
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)
              if f.name not in override}
    return cls(**values, **override)


def _server_info(msg: pb.ServerInfoResponse) -> ServerInfo:
    return _plain(
        ServerInfo,
        msg,
        model=_plain(ModelSpec, msg.model, layers=tuple(msg.model.layers)),
        devices=tuple(_plain(DeviceInfo, d) for d in msg.devices),
        datatypes=tuple(msg.datatypes),
        max_attended_positions=msg.limits.max_attended_positions,
        absorption=_plain(AbsorptionInfo, msg.absorption) if msg.HasField("absorption") else None,
        tiers=tuple(_plain(TierInfo, t) for t in msg.tiers),
        prefix_cache=(_plain(PrefixCacheInfo, msg.prefix_cache) if msg.HasField("prefix_cache")
                      else None),
        replication=(_plain(ReplicationInfo, msg.replication, peers=tuple(msg.replication.peers))
                     if msg.HasField("replication") else None),
        load=_plain(LoadInfo, msg.load) if msg.HasField("load") else None,
    )


@dataclasses.dataclass(frozen=True)
class Candidates:
    """A context-parallel full layer's candidates (docs/numerics.md): per query its best keys in
    absolute terms, positions (token, page_union) or page ids (``pages``: page_budget), best first
    (ties to the lower key); a query that attends every visible key has none. What
    ``attend_layer(..., candidates=True)`` returns and ``selection=`` takes (merged by
    :func:`merge_candidates`)."""

    pages: bool
    keep: int  # how many a query keeps after merging (K, or the budget)
    count: np.ndarray  # int32 [T]
    keys: np.ndarray  # int64 [sum(count)]
    scores: np.ndarray  # float32 [sum(count)]

    @classmethod
    def from_proto(cls, c: pb.Candidates) -> Candidates:
        return cls(pages=c.pages, keep=int(c.keep), count=np.array(c.count, np.int32),
                   keys=np.array(c.keys, np.int64), scores=np.array(c.scores, np.float32))

    def to_proto(self) -> pb.Candidates:
        return pb.Candidates(pages=bool(self.pages), keep=int(self.keep),
                             count=[int(x) for x in self.count], keys=[int(x) for x in self.keys],
                             scores=[float(x) for x in self.scores])


@dataclasses.dataclass(frozen=True)
class LayerResult:
    """A layer call's reply with its details (``attend_layer(..., details=True)``)."""

    out: Optional[np.ndarray]  # [T, H, L], None on write-only steps
    server_seconds: float  # the server's time on the message (checks, shared memory, compute)
    attended: Optional[List[np.ndarray]]  # [T] int32 key positions, when asked (attended=True)
    committed: bool  # the step committed (its last layer)
    # [T, H] float32 natural-log log-sum-exp of each query head's scores, when asked (lse=True):
    # partial attentions over disjoint key sets merge by it (:func:`merge_attention`)
    lse: Optional[np.ndarray] = None
    # A committing reply from a replica with standby replicas (docs/replication.md): for each
    # batch entry, in order, where its committed rows stand: "replicated" (its standby holds
    # them), "shipping" (async: on their way, within the lag bound) or "unprotected" (no standby
    # holds them yet: a crash of this replica would lose them). Empty otherwise.
    protection: Tuple[str, ...] = ()
