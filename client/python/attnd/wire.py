"""Layer calls on the wire: a step's batch as a ``BeginStepRequest``, a layer's tensors as a
``LayerInputs`` message, and a ``LayerOutput`` reply decoded (the output array, or a
:class:`LayerResult`)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Dict, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from .errors import AttndError
from .shm import ShmTensor, TensorArg
from .tensors import _DTYPE_OF, _FP8, Fp8Tensor, as_numpy, from_tensor, to_tensor, to_torch
from .types import Batch, Candidates, LayerResult
from .v1 import attention_pb2 as pb

__all__ = ["LayerInputs", "LayerOutput", "decode_layer", "encode_layer"]

#: A layer call's output: an array of the query's dtype (a torch tensor with ``as_torch``), an
#: :class:`Fp8Tensor` with ``out_datatype="FP8_E4M3"``, or None on a write-only step.
LayerOutput = Union[np.ndarray, Fp8Tensor, None]

#: The tensor fields of :class:`LayerInputs`, in the order the message is built (and errors name).
TENSOR_FIELDS = ("q_latent", "q_nope", "q_rope", "kv_latent", "k_rope", "index_q", "index_k",
                 "index_w")


@dataclasses.dataclass(frozen=True, eq=False)
class LayerInputs:
    """Everything one layer call sends, taken alike by ``AttndClient.attend_layer(step_id,
    inputs)``, ``StepStream.layer(inputs)`` and ``await AsyncStepStream.layer(inputs)`` (and their
    ``*_details`` / ``*_candidates`` forms, which choose what comes back: the call, never a field
    here, decides the return type).

    ``layer``: the step's next layer. Tensors (numpy arrays, CPU torch tensors, DLPack arrays,
    :class:`ShmTensor` references or, for queries, :class:`Fp8Tensor`; all of one datatype):
    ``q_latent`` [T, H, L] or, with server-side absorption, ``q_nope`` [T, H, Dn]; ``q_rope``
    [T, H, R]; the new keys ``kv_latent`` [T, L] and ``k_rope`` [T, R] (required except from
    shards other than 0 and on context-parallel calls that write nothing); on full layers the
    indexer's ``index_q`` [T, Hi, Di], ``index_k`` [T, Di], ``index_w`` [T, Hi]. ``shard``: this
    message's shard of a sharded step (None: 0 on unary calls, the joined shard on a stream).
    ``out``: a :class:`ShmArena` slot the server writes the output into (the call then returns a
    view of it). ``out_datatype``: the reply's datatype instead of the query's ("BF16", "FP16",
    "FP32", or "FP8_E4M3": an :class:`Fp8Tensor`). ``return_lse`` / ``return_attended``: ask for
    each query head's log-sum-exp and each query's attended positions (details calls only).
    ``selection``: a context-parallel full layer's merged :class:`Candidates`. ``as_torch``: the
    output as a torch tensor."""

    layer: int
    q_latent: Optional[TensorArg] = None
    q_nope: Optional[TensorArg] = None
    q_rope: Optional[TensorArg] = None
    kv_latent: Optional[TensorArg] = None
    k_rope: Optional[TensorArg] = None
    index_q: Optional[TensorArg] = None
    index_k: Optional[TensorArg] = None
    index_w: Optional[TensorArg] = None
    shard: Optional[int] = None
    out: Optional[ShmTensor] = None
    out_datatype: Optional[str] = None
    return_lse: bool = False
    return_attended: bool = False
    selection: Optional[Candidates] = None
    as_torch: bool = False

    def tensors(self) -> Dict[str, Optional[TensorArg]]:
        """The tensor fields by name (None where not given), in :data:`TENSOR_FIELDS` order."""
        return {name: getattr(self, name) for name in TENSOR_FIELDS}

    @property
    def query(self) -> Optional[TensorArg]:
        """The query whose datatype the output takes: q_latent, or q_nope on an absorbed call."""
        return _query(self.q_latent, self.q_nope)


def encode_layer(inputs: LayerInputs, *, uint16_as_bf16: bool, default_shard: int = 0,
                 candidates: bool = False, keys_required: bool = True) -> pb.LayerInputs:
    """The one encoder of a layer call: ``inputs`` as the wire ``LayerInputs`` message, for every
    call style. ``default_shard`` stands in for ``inputs.shard=None``; ``candidates`` sets
    return_candidates (the candidates calls); ``keys_required=False`` lets a context-parallel call
    carry no keys. TypeError / ValueError for inputs the server would refuse anyway."""
    shard = default_shard if inputs.shard is None else inputs.shard
    return _layer_inputs(inputs.layer, inputs.tensors(), uint16_as_bf16, int(shard), inputs.out,
                         inputs.return_attended, inputs.return_lse, inputs.out_datatype,
                         candidates, inputs.selection, keys_required)


def decode_layer(reply: pb.LayerOutput, inputs: LayerInputs, uint16_as_bf16: bool, kind: str):
    """The reply to a layer call of ``kind``: "output" -> the output (:data:`LayerOutput`),
    "details" -> a :class:`LayerResult`, "candidates" -> :class:`Candidates`."""
    if kind == "candidates":
        return Candidates.from_proto(reply.candidates)
    raw = _raw_bf16(inputs.query, uint16_as_bf16)
    return _result(reply, raw, inputs.out, kind == "details", inputs.as_torch)


def check_output_call(inputs: LayerInputs, call: str) -> None:
    """ValueError if ``inputs`` asks for what only a details call returns (the plain call would
    drop it)."""
    if inputs.return_lse or inputs.return_attended:
        raise ValueError(f"return_lse / return_attended come back in a LayerResult: call "
                         f"{call}_details instead of {call}")


_LEGACY_KEYWORDS = frozenset(TENSOR_FIELDS + ("shard", "out", "details", "attended", "lse",
                                              "as_torch", "out_datatype", "candidates",
                                              "selection"))


def layer_call(call: str, inputs, legacy: dict) -> Tuple[LayerInputs, str]:
    """Sorts out a plain layer call (``call``: "attend_layer" or "layer"): a LayerInputs alone is
    the current form -> (inputs, "output"). The keyword form of the previous release
    (``call(layer, q_latent=..., details=..., candidates=...)``) builds the LayerInputs, warns
    (DeprecationWarning naming the new form) and returns the kind of reply that call returned."""
    if isinstance(inputs, LayerInputs):
        if legacy:
            raise TypeError(f"{call}(inputs) takes a LayerInputs alone, not also keywords "
                            f"{sorted(legacy)}")
        return inputs, "output"
    legacy = dict(legacy)
    layer = legacy.pop("layer") if inputs is None and "layer" in legacy else inputs
    if layer is None:
        raise TypeError(f"{call}() needs a LayerInputs")
    unknown = set(legacy) - _LEGACY_KEYWORDS
    if unknown:
        raise TypeError(f"{call}() got unexpected keyword arguments {sorted(unknown)}")
    details = bool(legacy.pop("details", False))
    candidates = bool(legacy.pop("candidates", False))
    lse = bool(legacy.pop("lse", False))
    attended = bool(legacy.pop("attended", False))
    built = LayerInputs(layer, **legacy, return_lse=lse, return_attended=attended)
    kind = "candidates" if candidates else "details" if details or lse or attended else "output"
    new = {"output": call, "details": f"{call}_details", "candidates": f"{call}_candidates"}[kind]
    warnings.warn(f"{call}(layer, q_latent=..., ...) with keywords is deprecated: call "
                  f"{new}(attnd.LayerInputs(layer, ...)) (lse= / attended= are LayerInputs' "
                  "return_lse / return_attended)", DeprecationWarning, stacklevel=3)
    return built, kind


def _dtype_of(x: Optional[TensorArg]) -> Optional[np.dtype]:
    if x is None:
        return None
    if isinstance(x, Fp8Tensor):
        return _FP8
    return x.dtype if isinstance(x, ShmTensor) else as_numpy(x).dtype


def _batch(batch: Batch, write_only: bool, num_shards: int = 0,
           position_offsets: Optional[Sequence[int]] = None,
           query_positions: Optional[Sequence[int]] = None,
           block_hashes: Optional[Sequence[Sequence[bytes]]] = None,
           generations: Optional[Sequence[int]] = None,
           starts: Optional[Sequence[int]] = None) -> pb.BeginStepRequest:
    entries = [pb.BatchEntry(sequence_id=sid, q_len=int(q_len)) for sid, q_len in batch]
    for name, values in (("position_offsets", position_offsets),
                         ("query_positions", query_positions), ("block_hashes", block_hashes),
                         ("generations", generations), ("starts", starts)):
        if values is not None and len(values) != len(entries):
            raise ValueError(f"{name}: {len(values)} values for {len(entries)} batch entries")
    if query_positions is not None and position_offsets is None:
        raise ValueError("query_positions (attend-only) needs position_offsets")
    for i, e in enumerate(entries):
        if position_offsets is not None:
            e.position_offset = int(position_offsets[i])
        if query_positions is not None:
            e.query_position = int(query_positions[i])
        if block_hashes is not None:
            e.block_hashes.extend(bytes(h) for h in block_hashes[i])
        if generations is not None:
            e.generation = int(generations[i])
        if starts is not None and starts[i] is not None:
            e.start = int(starts[i])
    return pb.BeginStepRequest(batch=entries, write_only=write_only, num_shards=int(num_shards),
                               context_parallel=position_offsets is not None,
                               attend_only=query_positions is not None)


def _layer_inputs(layer: int, tensors: dict, uint16_as_bf16: bool, shard: int = 0,
                  out: Optional[ShmTensor] = None, attended: bool = False,
                  lse: bool = False, out_datatype: Optional[str] = None,
                  candidates: bool = False,
                  selection: Optional[Candidates] = None,
                  keys_required: bool = True) -> pb.LayerInputs:
    # Context-parallel calls may carry no keys (attend-only steps; a full layer's second call):
    # attnd.ContextParallelSequence passes keys_required=False.
    if keys_required and shard == 0 and not candidates and selection is None and (
            tensors["kv_latent"] is None or tensors["k_rope"] is None):
        raise TypeError("kv_latent and k_rope are required (only shards other than 0 of a sharded "
                        "step leave them out, and context-parallel calls that write nothing)")
    if out is not None:
        if not isinstance(out, ShmTensor):
            raise TypeError(f"out= takes a ShmTensor (a slot of a ShmArena), not {type(out)}")
        if out.arena is None:
            raise ValueError("out= needs a slot from ShmArena.alloc: the client reads the output "
                             "from the arena's memory")
        out.arena._mapping()  # ValueError if closed: before the server writes anything
    msg = pb.LayerInputs(layer=int(layer), shard=int(shard), return_attended=bool(attended),
                         return_lse=bool(lse), out_datatype=out_datatype or "",
                         return_candidates=bool(candidates))
    if selection is not None:
        msg.selection.CopyFrom(selection.to_proto())
    for name, value in tensors.items():
        if value is None:
            continue
        if isinstance(value, ShmTensor):
            getattr(msg, name).CopyFrom(value.to_tensor(uint16_as_bf16=uint16_as_bf16))
        elif isinstance(value, Fp8Tensor):
            getattr(msg, name).CopyFrom(value.to_tensor())
        else:
            getattr(msg, name).CopyFrom(to_tensor(value, uint16_as_bf16=uint16_as_bf16))
    kinds = {name: getattr(msg, name).datatype for name, v in tensors.items()
             if v is not None and not isinstance(v, Fp8Tensor)}  # fp8 queries carry their scales
    if len(set(kinds.values())) > 1:
        raise TypeError("one datatype per layer call, got " +
                        ", ".join(f"{n} {d}" for n, d in kinds.items()))
    if out is not None:
        msg.out_shm.CopyFrom(out.ref())
    return msg


def _output(out: pb.LayerOutput, raw_bf16: bool,
            slot: Optional[ShmTensor] = None) -> Optional[np.ndarray]:
    if not out.HasField("out") or not out.out.datatype:
        return None  # a write-only step
    if out.out.datatype == "FP8_E4M3":  # out_datatype="FP8_E4M3": codes and per-row scales
        return Fp8Tensor(codes=from_tensor(out.out), scales=from_tensor(out.out.scales))
    if slot is None:
        return from_tensor(out.out, uint16_as_bf16=raw_bf16)
    # out_shm: the server wrote the output into the slot; the reply names it and carries no bytes
    t = out.out
    dt = np.dtype(np.uint16) if t.datatype == "BF16" and raw_bf16 else _DTYPE_OF.get(t.datatype)
    if dt is None:
        raise ValueError(f"unsupported tensor datatype {t.datatype!r}")
    got = ShmTensor(slot.region, slot.offset, dt, tuple(t.shape), arena=slot.arena)
    if t.data:  # a server that ignored out_shm: put the bytes where they were asked for
        return slot.arena.write(got, from_tensor(t, uint16_as_bf16=raw_bf16))
    if not t.HasField("shm") or t.shm != slot.ref() or got.nbytes != slot.nbytes:
        raise AttndError(grpc.StatusCode.INTERNAL,
                         f"out_shm: the reply's output {t.datatype}{list(t.shape)} at "
                         f"{t.shm.region!r}+{t.shm.offset} ({t.shm.byte_size} bytes) is not the "
                         f"slot {slot.region!r}+{slot.offset} ({slot.nbytes} bytes) asked for")
    return slot.arena.read(got)


def _result(reply: pb.LayerOutput, raw: bool, slot: Optional[ShmTensor], details: bool,
            as_torch: bool = False):
    out = _output(reply, raw, slot)
    if as_torch and out is not None and not isinstance(out, Fp8Tensor):
        out = to_torch(out)
    if not details:
        return out
    attended = [np.array(a.positions, dtype=np.int32) for a in reply.attended] or None
    lse = from_tensor(reply.lse) if reply.HasField("lse") and reply.lse.datatype else None
    return LayerResult(out=out, server_seconds=reply.server_seconds, attended=attended,
                       committed=reply.committed, lse=lse, protection=tuple(reply.protection))


def _query(q_latent: Optional[TensorArg], q_nope: Optional[TensorArg]) -> Optional[TensorArg]:
    """The query whose datatype the output takes: q_latent, or q_nope on an absorbed call."""
    return q_latent if q_latent is not None else q_nope


def _raw_bf16(q_latent: Optional[TensorArg], uint16_as_bf16: bool) -> bool:
    return uint16_as_bf16 and _dtype_of(q_latent) == np.uint16
