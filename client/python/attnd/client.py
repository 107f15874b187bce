"""A small numpy-facing client of the attnd.v1 gRPC API (proto/attnd/v1/attention.proto).

Tensors go in and out as numpy arrays; the wire datatype follows the array's dtype:

======================  ========
numpy dtype             wire
======================  ========
``numpy.float32``       ``FP32``
``numpy.float16``       ``FP16``
``ml_dtypes.bfloat16``  ``BF16``
``numpy.uint16``        ``BF16`` (raw bf16 bits; only with ``uint16_as_bf16=True``)
======================  ========

Arrays are sent little-endian, row-major, without padding, whatever their memory layout. A layer's
output comes back as an array of q_latent's dtype and shape [T, H, L] ([T, H/num_shards, L] for one
shard of a sharded step).

A step runs two ways with one meaning: :meth:`AttndClient.stream` (one bidirectional ``Step`` RPC
carrying many steps; the fast path) and the unary calls :meth:`AttndClient.begin_step`,
:meth:`AttndClient.attend_layer` and :meth:`AttndClient.abort_step`. gRPC errors surface as
:class:`AttndError` with the status code and the server's message.

Sharded steps: the tensor-parallel shards of one worker share a step. Shard 0 opens it with
``num_shards=S`` (S dividing H); every other shard attaches with :meth:`StepStream.join` (or, unary,
calls :meth:`AttndClient.attend_layer` with the step id). Per layer each shard sends its heads of
q_latent / q_rope ([T, H/S, *]) with ``shard=k``; shard 0 alone also sends kv_latent, k_rope and
the indexer tensors. Each shard's call returns when every shard's message for the layer is in, with
that shard's heads of the output, [T, H/S, L].

Shared memory (a client on the server's host): :class:`ShmArena` creates a POSIX shared-memory
object, :meth:`ShmArena.register` registers it as a region, :meth:`ShmArena.put` writes arrays into
aligned slots and returns :class:`ShmTensor` references, which ``layer`` / ``attend_layer`` accept
in place of any array; ``out=`` (a slot from :meth:`ShmArena.alloc`) has the server write the output
into the region, and the call returns a numpy view of that slot.

Example::

    with AttndClient("localhost:50051") as client:
        spec = client.info().model
        client.open_sequence("s1")
        with client.stream() as stream:
            stream.begin([("s1", T)])
            for i in range(spec.num_layers):
                out = stream.layer(i, q_latent=..., q_rope=..., kv_latent=..., k_rope=...,
                                   index_q=..., index_k=..., index_w=...)  # indexer: full layers
        # the same with no tensor bytes on the wire (a client on the server's host)
        with ShmArena(64 << 20) as arena, client.stream() as stream:
            arena.register(client)
            stream.begin([("s1", 1)])
            out = arena.alloc((1, spec.num_heads, spec.kv_lora_rank), ml_dtypes.bfloat16)
            mark = arena.used
            for i in range(spec.num_layers):
                arena.reset(mark)  # reuse the input slots layer after layer
                y = stream.layer(i, q_latent=arena.put(q_latent), ..., out=out)  # y views `out`
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import queue
import sys
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import grpc
import ml_dtypes
import numpy as np

from .v1 import attention_pb2 as pb
from .v1 import attention_pb2_grpc as pb_grpc

__all__ = [
    "AttndClient",
    "AttndError",
    "Batch",
    "DeviceInfo",
    "ModelSpec",
    "SequenceInfo",
    "ServerInfo",
    "ShmArena",
    "ShmTensor",
    "StepInfo",
    "StepStream",
    "TensorArg",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "from_tensor",
    "to_tensor",
]

#: Raises gRPC's default 4 MiB receive limit: a DeepSeek-sized layer message is ~300 KB per token.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30

#: A step's batch: (sequence_id, q_len) pairs; tensors hold sum(q_len) rows in this order.
Batch = Sequence[Tuple[str, int]]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_NAME_OF = {np.dtype(np.float32): "FP32", np.dtype(np.float16): "FP16", _BF16: "BF16"}
_DTYPE_OF = {name: dt for dt, name in _NAME_OF.items()}
_DTYPE_OF["FP8_E4M3"] = _FP8  # keys as an fp8 cache holds them (exports), with their scales


class AttndError(Exception):
    """A failed attnd call: ``code`` is the grpc.StatusCode, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> "AttndError":
        code = error.code() if callable(getattr(error, "code", None)) else None
        details = error.details() if callable(getattr(error, "details", None)) else None
        return cls(code or grpc.StatusCode.UNKNOWN, details or str(error))


# ---- tensors -----------------------------------------------------------------------------------


def _native(dtype: np.dtype) -> np.dtype:
    return dtype if dtype.byteorder in "=|" else dtype.newbyteorder("=")


def _wire_name(dtype: np.dtype, uint16_as_bf16: bool) -> str:
    """The wire datatype of a (native byte order) numpy dtype; TypeError if it has none."""
    if dtype == np.uint16 and uint16_as_bf16:
        return "BF16"
    if dtype in _NAME_OF:
        return _NAME_OF[dtype]
    raise TypeError(
        f"unsupported tensor dtype {dtype}: use float32, float16 or ml_dtypes.bfloat16"
        + (" (or uint16 bf16 bits with uint16_as_bf16=True)" if dtype == np.uint16 else "")
    )


def as_numpy(x) -> np.ndarray:
    """``x`` as a numpy array, sharing memory where it can: a CPU torch tensor (any layout;
    torch.bfloat16 as ml_dtypes.bfloat16, reinterpreting the same bytes), any other object
    offering DLPack (``__dlpack__``), or anything np.asarray takes. A tensor that requires grad
    is detached (its values are what is sent); one on a GPU raises TypeError naming its device
    (move it first: attnd never copies device memory behind a caller's back)."""
    if isinstance(x, np.ndarray):
        return x
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise TypeError(f"a torch tensor on {x.device}: attnd takes CPU tensors (.cpu())")
        if x.requires_grad:
            x = x.detach()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    if hasattr(x, "__dlpack__") and not isinstance(x, (list, tuple)):
        return np.from_dlpack(x)
    return np.asarray(x)


def to_torch(a: np.ndarray):
    """A numpy array as a CPU torch tensor sharing its memory (ml_dtypes.bfloat16 as
    torch.bfloat16, the same bytes)."""
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if a.dtype == np.uint16:  # raw bf16 bits (uint16_as_bf16): torch before 2.3 has no uint16
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def to_tensor(array, *, uint16_as_bf16: bool = False) -> pb.Tensor:
    """A numpy array (or a CPU torch tensor, or any DLPack array: see :func:`as_numpy`) as a wire
    Tensor (little-endian, row-major, no padding).

    float32 -> FP32, float16 -> FP16, bfloat16 (ml_dtypes or torch) -> BF16, and uint16 -> BF16
    (the raw bits) when ``uint16_as_bf16``. Any byte order and memory layout is accepted. Raises
    TypeError for other dtypes.
    """
    a = as_numpy(array)
    dt = _native(a.dtype)
    name = _wire_name(dt, uint16_as_bf16)
    size = dt.itemsize
    native = np.ascontiguousarray(a, dtype=dt)
    data = native.view(f"=u{size}").astype(f"<u{size}", copy=False).tobytes()
    return pb.Tensor(datatype=name, shape=list(a.shape), data=data)


def from_tensor(tensor: pb.Tensor, *, uint16_as_bf16: bool = False,
                dequantize: bool = False) -> np.ndarray:
    """A wire Tensor as a (writable) numpy array; BF16 as uint16 bits when ``uint16_as_bf16``.
    FP8_E4M3 (an fp8 server's exported keys) comes as ``ml_dtypes.float8_e4m3fn`` codes, or with
    ``dequantize=True`` as float32 values: each code times its scale from ``tensor.scales``."""
    if tensor.datatype == "FP8_E4M3" and dequantize:
        codes = from_tensor(tensor).astype(np.float32)
        scales = from_tensor(tensor.scales)
        if scales.ndim != codes.ndim or codes.shape[-1] % max(scales.shape[-1], 1):
            raise ValueError(f"FP8_E4M3 {list(codes.shape)}: scales {list(scales.shape)}")
        return codes * np.repeat(scales, codes.shape[-1] // scales.shape[-1], axis=-1)
    dt = _DTYPE_OF.get(tensor.datatype)
    if dt is None:
        raise ValueError(f"unsupported tensor datatype {tensor.datatype!r}")
    shape = tuple(int(d) for d in tensor.shape)
    size = dt.itemsize
    want = int(np.prod(shape, dtype=np.int64)) * size
    if len(tensor.data) != want:
        raise ValueError(
            f"tensor {tensor.datatype}{list(shape)}: {len(tensor.data)} bytes, expected {want}"
        )
    bits = np.frombuffer(tensor.data, dtype=f"<u{size}").astype(f"=u{size}")  # a writable copy
    if tensor.datatype == "BF16" and uint16_as_bf16:
        return bits.reshape(shape)
    return bits.view(dt).reshape(shape)


# ---- shared memory -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShmTensor:
    """A tensor held in a registered shared-memory region: ``region`` (the name given to
    RegisterSharedMemory), ``offset`` (bytes into the region), ``dtype`` and ``shape``.

    Pass one wherever ``layer`` / ``attend_layer`` take an array (the message then carries the
    reference instead of the bytes, which must be little-endian, row-major, unpadded), or as
    ``out=`` to have the server write the layer output there. :meth:`ShmArena.alloc` and
    :meth:`ShmArena.put` make them with ``arena`` set: the memory the client reads ``out=`` from.
    """

    region: str
    offset: int
    dtype: np.dtype
    shape: Tuple[int, ...]
    arena: Optional["ShmArena"] = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _native(np.dtype(self.dtype)))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "offset", int(self.offset))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def ref(self) -> pb.SharedMemoryRef:
        """The wire reference: region, offset and byte_size."""
        return pb.SharedMemoryRef(region=self.region, offset=self.offset, byte_size=self.nbytes)

    def to_tensor(self, *, uint16_as_bf16: bool = False) -> pb.Tensor:
        """The wire Tensor: datatype and shape, and ``shm`` instead of ``data``."""
        return pb.Tensor(datatype=_wire_name(self.dtype, uint16_as_bf16), shape=list(self.shape),
                         shm=self.ref())


#: A layer input: a numpy array (its bytes go in the message) or a reference into shared memory.
TensorArg = Union[np.ndarray, ShmTensor, "Fp8Tensor"]


class ShmArena:
    """A POSIX shared-memory object (``multiprocessing.shared_memory``) carved into aligned slots.

    ``ShmArena(size)`` creates the object (``name`` defaults to a fresh "attnd-<pid>-<hex>";
    ``/dev/shm/<name>`` on Linux); :meth:`attach` (or ``create=False``, ``size`` then ignored)
    maps an existing one, e.g. another process's. Its key for RegisterSharedMemory is ``"/" + name``; :meth:`register`
    registers the whole object as region ``region`` (default: ``name``). Slots are bump-allocated
    ``alignment`` bytes apart: :meth:`alloc` reserves one, :meth:`put` reserves one and writes an
    array into it, :meth:`write` overwrites one, :meth:`read` views one, :meth:`reset` frees the
    slots allocated after a mark (``used``). Not thread-safe.

    Lifetime: :meth:`close` (or leaving the ``with`` block) unregisters the region from the
    clients it was registered with, unmaps the memory and — when this arena created the object —
    unlinks it. The creator's object stays known to the multiprocessing resource tracker only as a
    safety net against a crash (close() unregisters it, so nothing is warned about or unlinked
    twice); an attached arena is never tracked, so no process but the creator unlinks the object.
    Arrays returned by :meth:`read` (and by ``out=`` calls) view the mapping: drop or copy them
    before close(), which otherwise unlinks but raises BufferError instead of unmapping.
    """

    def __init__(self, size: int, name: Optional[str] = None, *, region: Optional[str] = None,
                 alignment: int = 64, create: bool = True) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment {alignment}: not a power of two")
        if name is None:
            if not create:
                raise ValueError("attaching (create=False) needs the object's name")
            name = f"attnd-{os.getpid()}-{os.urandom(4).hex()}"
        name = name.lstrip("/")
        if create:
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=int(size))
        else:
            self._shm = _attach_untracked(name)
        self._owner = create
        self.name: str = self._shm.name.lstrip("/")
        self.region: str = region or self.name
        self.size: int = int(size) if create else self._shm.size
        self.alignment = int(alignment)
        self._used = 0
        self._clients: List["AttndClient"] = []
        self._unmapped: Optional[shared_memory.SharedMemory] = None  # closed, not yet unmapped

    @classmethod
    def attach(cls, name: str, *, region: Optional[str] = None, alignment: int = 64
               ) -> "ShmArena":
        """Maps the existing object ``name`` (created by another ShmArena, possibly in another
        process) without owning it: close() unmaps but does not unlink it."""
        return cls(0, name, region=region, alignment=alignment, create=False)

    # -- the object --

    @property
    def key(self) -> str:
        """The POSIX shared-memory name, as for shm_open: ``"/" + name``."""
        return "/" + self.name

    @property
    def buf(self) -> memoryview:
        return self._mapping().buf

    @property
    def used(self) -> int:
        """Bytes allocated so far (a mark for :meth:`reset`)."""
        return self._used

    @property
    def closed(self) -> bool:
        return self._shm is None

    def _mapping(self) -> shared_memory.SharedMemory:
        if self._shm is None:
            raise ValueError(f"shared-memory arena {self.name!r} is closed")
        return self._shm

    # -- slots --

    def slot(self, offset: int, shape: Sequence[int], dtype) -> ShmTensor:
        """A reference to ``offset`` in this arena's region, allocating nothing (and checking no
        bounds: the server does)."""
        return ShmTensor(self.region, offset, np.dtype(dtype), tuple(shape), arena=self)

    def alloc(self, shape: Sequence[int], dtype) -> ShmTensor:
        """Reserves an aligned slot for a ``dtype`` array of ``shape``; MemoryError when full."""
        t = self.slot(0, shape, dtype)
        start = -(-self._used // self.alignment) * self.alignment
        if start + t.nbytes > self.size:
            raise MemoryError(f"shared-memory arena {self.name!r}: {t.nbytes} bytes do not fit "
                              f"({self._used} of {self.size} used)")
        self._used = start + t.nbytes
        return dataclasses.replace(t, offset=start)

    def put(self, array: np.ndarray) -> ShmTensor:
        """Allocates a slot for ``array`` and writes it there (little-endian, row-major)."""
        a = as_numpy(array)
        _check_dtype(a.dtype)
        return self.write(self.alloc(a.shape, a.dtype), a)

    def write(self, slot: ShmTensor, array: np.ndarray) -> ShmTensor:
        """Writes ``array`` (the slot's shape; any layout and byte order; a CPU torch tensor or
        DLPack array too) into ``slot``."""
        a = as_numpy(array)
        if a.shape != slot.shape or _native(a.dtype) != slot.dtype:
            raise ValueError(f"array {a.dtype}{list(a.shape)} does not fit slot "
                             f"{slot.dtype}{list(slot.shape)}")
        size = slot.dtype.itemsize
        self._check_slot(slot)
        dst = self._view(slot, np.dtype(f"<u{size}"))
        dst[...] = np.ascontiguousarray(a, dtype=slot.dtype).view(f"=u{size}")
        return slot

    def read(self, slot: ShmTensor, *, copy: bool = False, as_torch: bool = False):
        """The slot's contents as a ``slot.dtype`` array of ``slot.shape``: a view of the shared
        memory (valid until the slot is rewritten; it keeps close() from unmapping), or a copy;
        ``as_torch``: the same as a torch tensor sharing that memory."""
        if as_torch:
            return to_torch(self.read(slot, copy=copy))
        self._check_slot(slot)
        if sys.byteorder == "little":
            view = self._view(slot, slot.dtype)
            return view.copy() if copy else view
        size = slot.dtype.itemsize  # big-endian host: the bytes are little-endian; always a copy
        return self._view(slot, np.dtype(f"<u{size}")).astype(f"=u{size}").view(slot.dtype)

    def _view(self, slot: ShmTensor, dtype: np.dtype) -> np.ndarray:
        # np.frombuffer holds a buffer export of the memoryview, so close() cannot unmap the memory
        # under a live view (np.ndarray(buffer=...) does not, and would crash on access).
        count = int(np.prod(slot.shape, dtype=np.int64))
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=slot.offset).reshape(
            slot.shape)

    def reset(self, mark: int = 0) -> None:
        """Frees every slot allocated after ``mark`` (a value of ``used``; 0: all of them)."""
        if not 0 <= mark <= self._used:
            raise ValueError(f"reset mark {mark} outside [0, {self._used}]")
        self._used = mark

    def _check_slot(self, slot: ShmTensor) -> None:
        if slot.region != self.region:
            raise ValueError(f"slot of region {slot.region!r}, not this arena's {self.region!r}")
        if slot.offset < 0 or slot.offset + slot.nbytes > self.size:
            raise ValueError(f"slot [{slot.offset}, {slot.offset + slot.nbytes}) outside arena "
                             f"{self.name!r} of {self.size} bytes")

    # -- registration --

    def register(self, client: "AttndClient") -> None:
        """Registers the whole object as region ``region`` with ``client``'s server (once per
        server); close() unregisters it. A sync :class:`AttndClient` (close() must unregister
        without an event loop); with an async client, ``await client.register_shared_memory(
        arena.region, arena.key, arena.size)`` and unregister it yourself."""
        if not isinstance(client, AttndClient):
            raise TypeError("ShmArena.register takes an AttndClient (for an AsyncAttndClient: "
                            "await client.register_shared_memory(arena.region, arena.key, "
                            "arena.size))")
        client.register_shared_memory(self.region, self.key, self.size)
        self._clients.append(client)

    def unregister(self, client: "AttndClient") -> None:
        """Unregisters the region from ``client``'s server."""
        client.unregister_shared_memory(self.region)
        if client in self._clients:
            self._clients.remove(client)

    # -- lifetime --

    def close(self) -> None:
        """Unregisters the region from the clients registered through :meth:`register` (a region
        already gone is fine), unlinks the object if this arena created it, and unmaps it.

        BufferError while arrays from :meth:`read` (or ``out=`` calls) still view the memory: the
        rest is done; drop them and call close() again to unmap."""
        errors: List[Exception] = []
        if self._shm is not None:
            for client in list(self._clients):
                try:
                    self.unregister(client)
                except AttndError as e:
                    if e.code != grpc.StatusCode.NOT_FOUND:
                        errors.append(e)
                except ValueError as e:  # a closed channel
                    errors.append(e)
            self._clients.clear()
            self._unmapped, self._shm = self._shm, None
            if self._owner:
                self._unmapped.unlink()  # also tells the resource tracker: nothing to clean up
        if self._unmapped is not None:
            try:
                self._unmapped.close()
            except BufferError as e:
                raise BufferError(
                    f"shared-memory arena {self.name!r}: numpy arrays still view it (read() or "
                    "out= results); drop or copy them, then close() again to unmap it (it is "
                    "already unregistered and unlinked)") from e
            self._unmapped = None
        if errors:
            raise errors[0]

    def __enter__(self) -> "ShmArena":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except (BufferError, AttndError):
            if exc_type is None:
                raise  # otherwise keep the body's exception

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self._used}/{self.size} bytes used"
        return f"ShmArena(name={self.name!r}, region={self.region!r}, {state})"


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Attaches to an existing object without the resource tracker adopting it (before Python
    3.13 attaching registers the object, and the tracker unlinks it when this process exits)."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")  # the "/"-prefixed name it registered
    return shm


def _check_dtype(dtype: np.dtype) -> None:
    dt = _native(dtype)
    if dt not in _NAME_OF and dt != np.uint16:
        _wire_name(dt, False)  # raises the usual TypeError


def _dtype_of(x: Optional[TensorArg]) -> Optional[np.dtype]:
    if x is None:
        return None
    if isinstance(x, Fp8Tensor):
        return _FP8
    return x.dtype if isinstance(x, ShmTensor) else as_numpy(x).dtype


@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """A query as FP8_E4M3 codes with one float32 scale per row of its last axis (per token and
    head: DESIGN §13), a quarter of float32's bytes on the wire; the server dequantises it as
    code x scale in float32. Make one with :func:`quantize_fp8`; pass it as q_latent, q_nope,
    q_rope or index_q (the other tensors keep their datatype; the output comes back as BF16).
    A layer call with ``out_datatype="FP8_E4M3"`` returns its output as one (power-of-two
    scales)."""

    codes: np.ndarray  # ml_dtypes.float8_e4m3fn [..., D]
    scales: np.ndarray  # float32 [..., 1]

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.codes.shape)

    def dequantize(self) -> np.ndarray:
        """The values the server attends with: code x scale, in float32."""
        return self.codes.astype(np.float32) * self.scales.astype(np.float32)

    def to_tensor(self) -> pb.Tensor:
        t = pb.Tensor(datatype="FP8_E4M3", shape=list(self.codes.shape),
                      data=np.ascontiguousarray(self.codes).view(np.uint8).tobytes())
        t.scales.CopyFrom(to_tensor(np.ascontiguousarray(self.scales, dtype=np.float32)))
        return t


def quantize_fp8(x) -> Fp8Tensor:
    """A query [..., D] (any float array, torch tensor or DLPack array) as FP8_E4M3 with one
    scale per row of the last axis: scale = max |x| / 448 over the row (1 for an all-zero row),
    codes = x / scale rounded to nearest e4m3."""
    a = np.asarray(as_numpy(x), dtype=np.float32)
    if a.ndim < 1 or a.shape[-1] == 0:
        raise ValueError(f"quantize_fp8: needs [..., D] with D > 0, got {list(a.shape)}")
    amax = np.abs(a).max(axis=-1, keepdims=True)
    if not np.isfinite(amax).all():
        raise ValueError("quantize_fp8: the query holds NaN or infinity")
    # The smallest normal float32 at least, so that a row of tiny values keeps a nonzero scale.
    scales = np.where(amax > 0, np.maximum(amax / np.float32(448.0), np.finfo(np.float32).tiny),
                      np.float32(1.0)).astype(np.float32)
    codes = np.clip(a / scales, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return Fp8Tensor(codes=codes, scales=scales)


# ---- plain data --------------------------------------------------------------------------------


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
    absorption: Optional["AbsorptionInfo"] = None
    # serves context-parallel steps (False on servers too old to know them: never drive one)
    context_parallel: bool = False


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


@dataclasses.dataclass(frozen=True)
class StepInfo:
    step_id: int
    num_tokens: int  # T = sum(q_len)


def _plain(cls, msg, **override):
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls) if f.name not in override}
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
    )


def _batch(batch: Batch, write_only: bool, num_shards: int = 0,
           position_offsets: Optional[Sequence[int]] = None,
           query_positions: Optional[Sequence[int]] = None) -> pb.BeginStepRequest:
    entries = [pb.BatchEntry(sequence_id=sid, q_len=int(q_len)) for sid, q_len in batch]
    for name, values in (("position_offsets", position_offsets),
                         ("query_positions", query_positions)):
        if values is not None and len(values) != len(entries):
            raise ValueError(f"{name}: {len(values)} values for {len(entries)} batch entries")
    if query_positions is not None and position_offsets is None:
        raise ValueError("query_positions (attend-only) needs position_offsets")
    for i, e in enumerate(entries):
        if position_offsets is not None:
            e.position_offset = int(position_offsets[i])
        if query_positions is not None:
            e.query_position = int(query_positions[i])
    return pb.BeginStepRequest(batch=entries, write_only=write_only, num_shards=int(num_shards),
                               context_parallel=position_offsets is not None,
                               attend_only=query_positions is not None)


@dataclasses.dataclass(frozen=True)
class Candidates:
    """A context-parallel full layer's candidates (DESIGN §13): per query its best keys in
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
    def from_proto(cls, c: pb.Candidates) -> "Candidates":
        return cls(pages=c.pages, keep=int(c.keep), count=np.array(c.count, np.int32),
                   keys=np.array(c.keys, np.int64), scores=np.array(c.scores, np.float32))

    def to_proto(self) -> pb.Candidates:
        return pb.Candidates(pages=bool(self.pages), keep=int(self.keep),
                             count=[int(x) for x in self.count], keys=[int(x) for x in self.keys],
                             scores=[float(x) for x in self.scores])


def merge_candidates(parts: Sequence[Candidates]) -> Candidates:
    """Every server's candidates for one layer merged: per query all of them, best first (score
    descending, ties to the lower key), the first ``keep``: the global selection's candidates."""
    if not parts:
        raise ValueError("merge_candidates: no parts")
    first = parts[0]
    for p in parts:
        if len(p.count) != len(first.count) or p.keep != first.keep or p.pages != first.pages:
            raise ValueError("merge_candidates: the parts disagree on the queries, the keys' kind "
                             "or how many to keep")
        if int(p.count.sum()) != len(p.keys) or len(p.keys) != len(p.scores):
            raise ValueError("merge_candidates: counts, keys and scores disagree")
    starts = [np.concatenate([[0], np.cumsum(p.count)]) for p in parts]
    count, keys, scores = [], [], []
    for t in range(len(first.count)):
        k = np.concatenate([p.keys[s[t]:s[t + 1]] for p, s in zip(parts, starts)])
        v = np.concatenate([p.scores[s[t]:s[t + 1]] for p, s in zip(parts, starts)])
        order = np.lexsort((k, -v.astype(np.float64)))[:first.keep]
        count.append(len(order))
        keys.append(k[order])
        scores.append(v[order])
    return Candidates(pages=first.pages, keep=first.keep, count=np.array(count, np.int32),
                      keys=np.concatenate(keys).astype(np.int64) if keys else np.zeros(0, np.int64),
                      scores=(np.concatenate(scores).astype(np.float32) if scores
                              else np.zeros(0, np.float32)))


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


def _layer_inputs(layer: int, tensors: dict, uint16_as_bf16: bool, shard: int = 0,
                  out: Optional[ShmTensor] = None, attended: bool = False,
                  lse: bool = False, out_datatype: Optional[str] = None,
                  candidates: bool = False,
                  selection: Optional["Candidates"] = None,
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
                       committed=reply.committed, lse=lse)


def merge_attention(outs: Sequence, lses: Sequence) -> Tuple[np.ndarray, np.ndarray]:
    """Merges attention outputs computed over disjoint key sets (a sequence split over servers):
    ``outs[i]`` [T, H, L] and ``lses[i]`` [T, H] (``LayerResult.lse``). Returns (out, lse) in
    float32: out = sum_i exp(lse_i - lse) out_i with lse = log sum_i exp(lse_i), computed in
    float64. Parts whose lse is -inf (they saw no key) add nothing; a query head that no part saw
    gets out 0 and lse -inf, as one server attending nothing reports; a NaN lse makes its row NaN."""
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"merge_attention: {len(outs)} outputs and {len(lses)} lse arrays; "
                         "give one lse per output, at least one")
    o = [np.asarray(as_numpy(x), dtype=np.float64) for x in outs]
    e = [np.asarray(as_numpy(x), dtype=np.float64) for x in lses]
    for i, (oi, ei) in enumerate(zip(o, e)):
        if oi.ndim != 3 or ei.shape != oi.shape[:2] or oi.shape != o[0].shape:
            raise ValueError(f"merge_attention: part {i} has out {list(oi.shape)} and lse "
                             f"{list(ei.shape)}; every out must be [T, H, L] with lse [T, H]")
    stacked = np.stack(e)  # [P, T, H]
    nan = np.isnan(stacked).any(axis=0)  # a NaN part makes its row NaN, as in MergeAttention
    clean = np.where(np.isnan(stacked), -np.inf, stacked)
    top = clean.max(axis=0)
    safe = np.where(np.isneginf(top), 0.0, top)
    w = np.exp(clean - safe)  # exp(-inf) = 0: parts that saw nothing
    denom = w.sum(axis=0)
    # Parts of weight 0 add nothing, whatever their output holds.
    out = sum(np.where(wi[..., None] > 0, wi[..., None] * oi, 0.0) for wi, oi in zip(w, o))
    seen = denom > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(seen[..., None], out / np.where(seen, denom, 1.0)[..., None], 0.0)
        lse = np.where(seen, safe + np.log(np.where(seen, denom, 1.0)), -np.inf)
    out[nan] = np.nan
    lse[nan] = np.nan
    return out.astype(np.float32), lse.astype(np.float32)


def _query(q_latent: Optional[TensorArg], q_nope: Optional[TensorArg]) -> Optional[TensorArg]:
    """The query whose datatype the output takes: q_latent, or q_nope on an absorbed call."""
    return q_latent if q_latent is not None else q_nope


def _raw_bf16(q_latent: Optional[TensorArg], uint16_as_bf16: bool) -> bool:
    return uint16_as_bf16 and _dtype_of(q_latent) == np.uint16


# ---- the client --------------------------------------------------------------------------------


_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _health_request(service: str) -> bytes:
    """grpc.health.v1.HealthCheckRequest{service} on the wire (field 1, a string): no
    grpcio-health-checking needed, whichever protobuf it would pin."""
    data = service.encode()
    n, varint = len(data), bytearray()
    while True:
        varint.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            break
    return b"\x0a" + bytes(varint) + data if data else b""


def _health_status(data: bytes) -> str:
    """HealthCheckResponse.status (field 1, an enum) from the wire."""
    if len(data) >= 2 and data[0] == 0x08:
        return _HEALTH_STATUS.get(data[1], f"status {data[1]}")
    return "UNKNOWN"


class _Api:
    """Every unary RPC, written once: each method builds its request and names its reply's
    conversion; :class:`AttndClient` runs it and returns the result, :class:`AsyncAttndClient`
    returns an awaitable of the same result."""

    def _unary(self, rpc: str, request, convert=lambda r: None):
        raise NotImplementedError

    def _init_channel(self, grpc_module, target, max_message_bytes, options, root_certificates,
                      private_key, certificate_chain, server_name, token, act_as_tenant,
                      timeout, uint16_as_bf16) -> None:
        channel_options = [
            ("grpc.max_receive_message_length", int(max_message_bytes)),
            ("grpc.max_send_message_length", int(max_message_bytes)),
            *options,
        ]
        if (private_key is None) != (certificate_chain is None):
            raise ValueError("private_key and certificate_chain go together")
        if root_certificates is not None or certificate_chain is not None:
            if server_name:
                channel_options.append(("grpc.ssl_target_name_override", server_name))
            credentials = grpc.ssl_channel_credentials(root_certificates, private_key,
                                                       certificate_chain)
            self._channel = grpc_module.secure_channel(target, credentials,
                                                       options=channel_options)
        else:
            self._channel = grpc_module.insecure_channel(target, options=channel_options)
        self._stub = pb_grpc.AttentionStub(self._channel)
        self._health = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=_health_request,
            response_deserializer=_health_status)
        self._timeout = timeout
        self._uint16_as_bf16 = uint16_as_bf16
        metadata = []
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        if act_as_tenant:
            metadata.append(("attnd-tenant", act_as_tenant))
        self._metadata: Tuple[Tuple[str, str], ...] = tuple(metadata)

    # -- server and sequences --

    def info(self) -> ServerInfo:
        """The model spec, backend, devices and their capacity, version."""
        return self._unary("ServerInfo", pb.ServerInfoRequest(), _server_info)

    def open_sequence(
        self, sequence_id: str, fork_parent: Optional[str] = None, prefix_len: int = 0,
        import_length: int = 0,
    ) -> SequenceInfo:
        """Creates a sequence: empty, or the first ``prefix_len`` tokens of ``fork_parent``.
        ``import_length`` > 0 opens a handoff target that serves ordinary steps only once
        write-only steps have brought it to that length."""
        request = pb.OpenSequenceRequest(
            sequence_id=sequence_id, fork_parent_id=fork_parent or "", fork_prefix_len=prefix_len,
            import_length=import_length,
        )
        return self._unary("OpenSequence", request, lambda r: _plain(SequenceInfo, r))

    def close_sequence(self, sequence_id: str) -> None:
        """Frees a sequence's pages (FAILED_PRECONDITION while it is in an open step)."""
        return self._unary("CloseSequence", pb.CloseSequenceRequest(sequence_id=sequence_id))

    def describe_sequence(self, sequence_id: str) -> SequenceInfo:
        """A sequence's committed length, device, pages and whether it is in an open step."""
        request = pb.DescribeSequenceRequest(sequence_id=sequence_id)
        return self._unary("DescribeSequence", request, lambda r: _plain(SequenceInfo, r))

    def list_sequences(self, all_tenants: bool = False) -> List[SequenceInfo]:
        """This tenant's sequences; the admin identity may ask for every tenant's."""
        return self._unary("ListSequences", pb.ListSequencesRequest(all_tenants=all_tenants),
                           lambda r: [_plain(SequenceInfo, s) for s in r.sequences])

    def echo(self, payload: bytes = b"", response_bytes: int = 0) -> bytes:
        """The transport floor: the server returns ``response_bytes`` bytes for ``payload`` and
        touches no state (at most ServerInfo.limits.max_echo_bytes)."""
        return self._unary("Echo", pb.EchoRequest(payload=payload,
                                                  response_bytes=int(response_bytes)),
                           lambda r: r.payload)

    def drain(self, peers: Sequence[str] = ()) -> None:
        """Starts the server's drain, as SIGTERM does: every sequence is handed to a peer (``peers``
        or its --drain-peers), then it exits. The admin identity only on an authenticated server."""
        return self._unary("Drain", pb.DrainRequest(peers=list(peers)))

    # -- steps: unary --

    def begin_step(self, batch: Batch, *, write_only: bool = False, num_shards: int = 0,
                   position_offsets: Optional[Sequence[int]] = None,
                   query_positions: Optional[Sequence[int]] = None) -> StepInfo:
        """Opens a step over ``batch`` (reserving its pages); then attend_layer 0..N-1 in order.

        ``write_only`` imports keys only (kv_latent, k_rope, index_k; no queries, no output).
        ``num_shards`` > 1 opens a sharded step as its shard 0: S = num_shards tensor-parallel
        shards (S must divide H; not with ``write_only``) each send their H/S heads per layer —
        here through attend_layer with ``shard=k`` and this step id (unary shards need no join).

        Context parallelism (DESIGN §13; :class:`attnd.ContextParallelSequence` drives it):
        ``position_offsets`` (per entry, page-aligned) opens a context-parallel step over this
        server's slice of each sequence; with ``query_positions`` (per entry) an attend-only one,
        whose queries follow every key held here and write nothing.
        """
        return self._unary("BeginStep",
                           _batch(batch, write_only, num_shards, position_offsets, query_positions),
                           lambda r: StepInfo(step_id=r.step_id, num_tokens=r.num_tokens))

    def attend_layer(
        self,
        step_id: int,
        layer: int,
        *,
        q_latent: Optional[TensorArg] = None,
        q_nope: Optional[TensorArg] = None,
        q_rope: Optional[TensorArg] = None,
        kv_latent: Optional[TensorArg] = None,
        k_rope: Optional[TensorArg] = None,
        index_q: Optional[TensorArg] = None,
        index_k: Optional[TensorArg] = None,
        index_w: Optional[TensorArg] = None,
        shard: int = 0,
        out: Optional[ShmTensor] = None,
        details: bool = False,
        attended: bool = False,
        lse: bool = False,
        as_torch: bool = False,
        out_datatype: Optional[str] = None,
        candidates: bool = False,
        selection: Optional[Candidates] = None,
    ):
        """Runs the step's next layer; returns out [T, H, L] in q_latent's dtype (None if write-only;
        a torch tensor with ``as_torch``),
        or with ``details`` (implied by ``attended`` and ``lse``) a :class:`LayerResult`: the
        output, the server's seconds on the call, with ``attended`` each query's attended key
        positions (bounded by ServerInfo.limits.max_attended_positions; not on sharded steps) and
        with ``lse`` each query head's log-sum-exp [T, H] float32, by which outputs over disjoint
        key sets merge (:func:`merge_attention`; a shard's heads [T, H/S] on sharded steps; not
        on write-only steps).

        Server-side absorption (``info().absorption`` set): give ``q_nope`` [T, H, Dn] instead of
        q_latent; the server forms q_nope · W_UK and returns the values [T, H, V] (out_latent ·
        W_UV^T) instead of the latent output. Not on sharded steps.

        ``out_datatype``: the reply's datatype instead of the query's ("BF16", "FP16", "FP32"), or
        "FP8_E4M3": the output then comes as an :class:`Fp8Tensor` (e4m3 codes with one float32
        power-of-two scale per token and head, ``.dequantize()`` for the values), quantised from
        the float32 result: half the bytes of BF16, the input DeepSeek's fp8 o_proj takes. Not
        with ``out`` (shared memory), on sharded or on write-only steps.

        Context-parallel steps, full layers: first ``candidates=True`` with the keys (none on
        attend-only steps), index_q and index_w returns this server's :class:`Candidates`; then
        the layer again with ``selection=merge_candidates(every server's)`` and the queries only.

        The last layer commits the step. Any error aborts the step (sequences stay as before it).
        Indexer tensors (index_q [T,Hi,Di], index_k [T,Di], index_w [T,Hi]) go with full layers only.
        kv_latent and k_rope are required except from shards other than 0 (and on
        context-parallel calls that write nothing). Tensors are numpy
        arrays, CPU torch tensors or DLPack arrays (:func:`as_numpy`), all of one datatype.

        Any tensor may be a :class:`ShmTensor` (a reference into a registered shared-memory region)
        instead of an array. Sharded steps: ``shard`` is this message's shard; q_latent / q_rope
        hold its heads, [T, H/S, *]; shard 0 alone sends kv_latent, k_rope and the indexer tensors;
        the call returns once every shard's message for the layer is in, with this shard's heads,
        [T, H/S, L]. ``out``: a slot of a :class:`ShmArena` (its region registered, its byte size
        the output's) that the server writes the output into; the call then returns a view of the
        slot (valid until the slot is rewritten) instead of decoding bytes from the reply.
        """
        tensors = dict(q_latent=q_latent, q_nope=q_nope, q_rope=q_rope, kv_latent=kv_latent, k_rope=k_rope,
                       index_q=index_q, index_k=index_k, index_w=index_w)
        request = pb.AttendLayerRequest(
            step_id=step_id,
            inputs=_layer_inputs(layer, tensors, self._uint16_as_bf16, shard, out, attended, lse,
                                 out_datatype, candidates, selection),
        )
        if candidates:
            return self._unary("AttendLayer", request,
                               lambda r: Candidates.from_proto(r.output.candidates))
        raw = _raw_bf16(_query(q_latent, q_nope), self._uint16_as_bf16)
        return self._unary(
            "AttendLayer", request,
            lambda r: _result(r.output, raw, out, details or attended or lse, as_torch))

    def abort_step(self, step_id: int) -> None:
        """Aborts an open step: every sequence in it is left as before the step."""
        return self._unary("AbortStep", pb.AbortStepRequest(step_id=step_id))

    # -- shared memory --

    def register_shared_memory(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        """Registers ``[offset, offset + byte_size)`` of the POSIX shared-memory object ``key`` (as
        for shm_open: "/attnd-worker-0") as region ``name``, for tensors and outputs of later layer
        calls. ALREADY_EXISTS (name in use), NOT_FOUND (no such object), INVALID_ARGUMENT (range).
        :meth:`ShmArena.register` registers a whole arena."""
        request = pb.RegisterSharedMemoryRequest(name=name, key=key, offset=int(offset),
                                                 byte_size=int(byte_size))
        return self._unary("RegisterSharedMemory", request)

    def unregister_shared_memory(self, name: str) -> None:
        """Forgets region ``name`` (NOT_FOUND if not registered); calls in flight keep using it."""
        return self._unary("UnregisterSharedMemory",
                           pb.UnregisterSharedMemoryRequest(name=name))


class AttndClient(_Api):
    """A connection to one attnd server.

    Args:
      target: "host:port" (any gRPC target); "unix:/path" reaches the server's Unix-socket
        listener, the only way to use shared memory.
      max_message_bytes: the channel's receive and send limit (gRPC's default receive limit, 4 MiB,
        is far too small for prefill layers); keep it at most the server's ``max_message_bytes``.
      timeout: a deadline in seconds for every unary call (None: none).
      uint16_as_bf16: accept uint16 arrays as raw bf16 bits (outputs then come back as uint16 too).
      options: extra gRPC channel options.
      root_certificates: PEM bytes of the CA that signed the server's certificate: speak TLS.
      private_key, certificate_chain: PEM bytes of this client's key and certificate (mTLS).
      server_name: the name to verify in the server's certificate instead of the target's host.
      token: a bearer token (sent as ``authorization: Bearer <token>`` on every call).
      act_as_tenant: the admin identity only: act inside this tenant's namespace.

    Thread safety: every method except :meth:`stream` may be called from several threads at
    once (gRPC channels are thread-safe, and the client keeps no per-call state); a
    :class:`StepStream` belongs to one thread. :class:`AsyncAttndClient` is the asyncio twin.
    """

    def __init__(
        self,
        target: str,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        timeout: Optional[float] = None,
        uint16_as_bf16: bool = False,
        options: Sequence[Tuple[str, object]] = (),
        root_certificates: Optional[bytes] = None,
        private_key: Optional[bytes] = None,
        certificate_chain: Optional[bytes] = None,
        server_name: Optional[str] = None,
        token: Optional[str] = None,
        act_as_tenant: Optional[str] = None,
    ) -> None:
        self._init_channel(grpc, target, max_message_bytes, options, root_certificates,
                           private_key, certificate_chain, server_name, token, act_as_tenant,
                           timeout, uint16_as_bf16)

    def upload_absorption(self, kv_b_proj: Sequence, qk_nope_head_dim: int, v_head_dim: int, *,
                          max_message_bytes: Optional[int] = None) -> bool:
        """Gives the server every layer's kv_b_proj weight ([H*(Dn+V), L] each, in layer order;
        float32, float16 or bfloat16 arrays or CPU torch tensors) for server-side absorption, in
        as many calls as the message limit needs. Returns True once the server uses them. The
        same weights again are a no-op; different ones once set are ALREADY_EXISTS. The admin
        identity only on an authenticated server."""
        limit = max_message_bytes or max(1, self.info().max_message_bytes - (1 << 16))
        layer, complete = 0, False
        while layer < len(kv_b_proj):
            batch, size = [], 0
            while layer + len(batch) < len(kv_b_proj):
                t = to_tensor(kv_b_proj[layer + len(batch)], uint16_as_bf16=self._uint16_as_bf16)
                if batch and size + len(t.data) > limit:
                    break
                batch.append(t)
                size += len(t.data)
            reply = self._unary("UploadAbsorption", pb.UploadAbsorptionRequest(
                qk_nope_head_dim=int(qk_nope_head_dim), v_head_dim=int(v_head_dim),
                first_layer=layer, kv_b_proj=batch), lambda r: r)
            layer += len(batch)
            complete = reply.complete
        return complete

    def _unary(self, rpc: str, request, convert=lambda r: None):
        return convert(self._call(getattr(self._stub, rpc), request))

    def _call(self, method, request):
        try:
            return method(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise AttndError.from_rpc_error(e) from e

    def health(self, service: str = "attnd.v1.Attention") -> str:
        """gRPC health: "SERVING", "NOT_SERVING" (draining, or not yet up) or "SERVICE_UNKNOWN";
        ``service=""`` asks about the process (liveness) rather than the API (readiness)."""
        try:
            return self._call(self._health, service)
        except AttndError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise

    # -- moving sequences --

    def export_sequence(self, sequence_id: str, chunk_tokens: int = 0) -> Iterator[pb.ExportChunk]:
        """The committed keys of a sequence, exactly as cached: for each chunk of tokens, one
        ``ExportChunk`` per layer in order (``keys`` are a write-only step's LayerInputs)."""
        request = pb.ExportSequenceRequest(sequence_id=sequence_id, chunk_tokens=int(chunk_tokens))
        try:
            yield from self._stub.ExportSequence(request, timeout=self._timeout,
                                                 metadata=self._metadata)
        except grpc.RpcError as e:
            raise AttndError.from_rpc_error(e) from e

    def handoff(self, sequence_id: str, to: "AttndClient", *, chunk_tokens: int = 0,
                close_source: bool = False) -> SequenceInfo:
        """Copies a sequence to the server behind ``to`` (same id): it is opened there as a
        handoff target (refusing ordinary steps until complete), filled with write-only steps
        from :meth:`export_sequence`, and its length checked; on failure the partial copy is
        closed. ``close_source`` closes it here once the copy is confirmed."""
        length = self.describe_sequence(sequence_id).length
        to.open_sequence(sequence_id, import_length=length)
        step = None
        try:
            for chunk in self.export_sequence(sequence_id, chunk_tokens):
                if chunk.keys.layer == 0:
                    step = to.begin_step([(sequence_id, chunk.tokens)], write_only=True)
                to._call(to._stub.AttendLayer,
                         pb.AttendLayerRequest(step_id=step.step_id, inputs=chunk.keys))
            step = None
            there = to.describe_sequence(sequence_id)
            if there.length != length or there.importing:
                raise AttndError(grpc.StatusCode.INTERNAL,
                                 f"handoff: the receiver holds {there.length} of {length} tokens")
            if close_source and self.describe_sequence(sequence_id).length != length:
                raise AttndError(grpc.StatusCode.ABORTED,
                                 f"handoff: {sequence_id!r} grew on the source during the copy")
        except BaseException:
            # The receiver's partial copy goes: its open write-only step first (a sequence in a
            # step cannot be closed), then the sequence.
            for cleanup in ((lambda: to.abort_step(step.step_id)) if step else None,
                            lambda: to.close_sequence(sequence_id)):
                if cleanup is not None:
                    try:
                        cleanup()
                    except AttndError:
                        pass
            raise
        if close_source:
            self.close_sequence(sequence_id)
        return there

    # -- steps: the stream --

    def stream(self, *, timeout: Optional[float] = None) -> "StepStream":
        """Opens a ``Step`` stream (many steps, one at a time). ``timeout`` bounds the whole stream."""
        return StepStream(self._stub, timeout=timeout, uint16_as_bf16=self._uint16_as_bf16,
                          metadata=self._metadata)

    # -- lifetime --

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "AttndClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncAttndClient(_Api):
    """The asyncio client (grpc.aio): the same methods and arguments as :class:`AttndClient`,
    each returning an awaitable — ``info = await client.info()`` — plus ``async with`` and
    :meth:`stream` (an :class:`AsyncStepStream`). Any number of calls may be in flight at once
    from one event loop (a step's layers still go in order). Shared-memory tensors work as with
    the sync client (the arena itself is registered through a sync client or
    ``await client.register_shared_memory(...)``)."""

    def __init__(self, target: str, **kwargs) -> None:
        defaults = dict(max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES, options=(),
                        root_certificates=None, private_key=None, certificate_chain=None,
                        server_name=None, token=None, act_as_tenant=None, timeout=None,
                        uint16_as_bf16=False)
        unknown = set(kwargs) - set(defaults)
        if unknown:
            raise TypeError(f"unexpected arguments {sorted(unknown)}")
        a = {**defaults, **kwargs}
        self._init_channel(grpc.aio, target, a["max_message_bytes"], a["options"],
                           a["root_certificates"], a["private_key"], a["certificate_chain"],
                           a["server_name"], a["token"], a["act_as_tenant"], a["timeout"],
                           a["uint16_as_bf16"])

    async def _await(self, method, request, convert):
        try:
            reply = await method(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:  # grpc.aio.AioRpcError is one
            raise AttndError.from_rpc_error(e) from e
        return convert(reply)

    def _unary(self, rpc: str, request, convert=lambda r: None):
        return self._await(getattr(self._stub, rpc), request, convert)

    async def health(self, service: str = "attnd.v1.Attention") -> str:
        """See :meth:`AttndClient.health`."""
        try:
            return await self._await(self._health, service, lambda status: status)
        except AttndError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise

    async def export_sequence(self, sequence_id: str, chunk_tokens: int = 0):
        """An async iterator over :meth:`AttndClient.export_sequence`'s chunks."""
        request = pb.ExportSequenceRequest(sequence_id=sequence_id, chunk_tokens=int(chunk_tokens))
        try:
            async for chunk in self._stub.ExportSequence(request, timeout=self._timeout,
                                                         metadata=self._metadata):
                yield chunk
        except grpc.RpcError as e:
            raise AttndError.from_rpc_error(e) from e

    async def handoff(self, sequence_id: str, to: "AsyncAttndClient", *, chunk_tokens: int = 0,
                      close_source: bool = False) -> SequenceInfo:
        """See :meth:`AttndClient.handoff`."""
        length = (await self.describe_sequence(sequence_id)).length
        await to.open_sequence(sequence_id, import_length=length)
        step = None
        try:
            async for chunk in self.export_sequence(sequence_id, chunk_tokens):
                if chunk.keys.layer == 0:
                    step = await to.begin_step([(sequence_id, chunk.tokens)], write_only=True)
                await to._await(to._stub.AttendLayer,
                                pb.AttendLayerRequest(step_id=step.step_id, inputs=chunk.keys),
                                lambda r: None)
            step = None
            there = await to.describe_sequence(sequence_id)
            if there.length != length or there.importing:
                raise AttndError(grpc.StatusCode.INTERNAL,
                                 f"handoff: the receiver holds {there.length} of {length} tokens")
            if close_source and (await self.describe_sequence(sequence_id)).length != length:
                raise AttndError(grpc.StatusCode.ABORTED,
                                 f"handoff: {sequence_id!r} grew on the source during the copy")
        except BaseException:
            if step is not None:
                try:
                    await to.abort_step(step.step_id)
                except AttndError:
                    pass
            try:
                await to.close_sequence(sequence_id)
            except AttndError:
                pass
            raise
        if close_source:
            await self.close_sequence(sequence_id)
        return there

    def stream(self, *, timeout: Optional[float] = None) -> "AsyncStepStream":
        """Opens a ``Step`` stream on this client's channel (see :class:`AsyncStepStream`)."""
        return AsyncStepStream(self._stub, timeout=timeout, uint16_as_bf16=self._uint16_as_bf16,
                               metadata=self._metadata)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncAttndClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class _StepBookkeeping:
    """What :class:`StepStream` and :class:`AsyncStepStream` share: the open step's state, each
    message's request and how its reply is taken in. The transport (blocking or asyncio) is
    theirs; each public call is `request -> roundtrip -> taken in`."""

    def _init_bookkeeping(self, stub, metadata, uint16_as_bf16: bool) -> None:
        self._stub = stub
        self._metadata = tuple(metadata)
        self._uint16_as_bf16 = uint16_as_bf16
        self._step: Optional[StepInfo] = None
        self._shard = 0
        self._next_layer = 0
        self._closed = False
        self._open_ids: List[str] = []

    @property
    def step(self) -> Optional[StepInfo]:
        """The open step, or None."""
        return self._step

    @property
    def shard(self) -> int:
        """The shard this stream plays in the open step: the joined shard, else 0."""
        return self._shard

    @property
    def next_layer(self) -> int:
        """The layer the open step expects next."""
        return self._next_layer

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the step stream is closed; open a new one with client.stream()")

    def _check_kind(self, response: pb.StepResponse, expect: str) -> pb.StepResponse:
        kind = response.WhichOneof("kind")
        if kind != expect:
            self.cancel()
            raise AttndError(grpc.StatusCode.INTERNAL,
                             f"Step stream: expected a {expect!r} reply, got {kind!r}")
        return response

    def _opened(self, info, batch: Optional[Batch], shard: int) -> StepInfo:
        self._step = StepInfo(step_id=info.step_id, num_tokens=info.num_tokens)
        self._open_ids = [sid for sid, _ in batch] if batch is not None else []
        self._shard = shard
        self._next_layer = 0
        return self._step

    def _layer_request(self, layer, tensors, shard, out, attended, lse, out_datatype=None,
                       candidates=False, selection=None) -> pb.StepRequest:
        shard = self._shard if shard is None else int(shard)
        return pb.StepRequest(
            layer=_layer_inputs(layer, tensors, self._uint16_as_bf16, shard, out, attended, lse,
                                out_datatype, candidates, selection))

    def _layered(self, response, layer, q_latent, out, details, attended, as_torch):
        self._next_layer = int(layer) + 1
        if response.layer.committed:
            self._step, self._shard = None, 0
        return _result(response.layer, _raw_bf16(q_latent, self._uint16_as_bf16), out,
                       details or attended, as_torch)

    def _aborted(self) -> None:
        self._step, self._shard = None, 0

    def _released_ids(self) -> List[str]:
        """The last begun step's sequences, once: what a cancel waits for the server to free."""
        ids, self._open_ids = self._open_ids, []
        return ids


class StepStream(_StepBookkeeping):
    """One bidirectional ``Step`` RPC carrying many steps, one open at a time.

    ``begin(batch)``, then ``layer(i, ...)`` for i = 0..N-1 (the last one commits), then the next
    ``begin`` — or ``abort()`` in between. Each call sends one message and waits for its reply. An
    error (raised as :class:`AttndError`) ends the stream and aborts its open step; open a new stream
    to go on. ``close()`` aborts an open step and ends the stream cleanly. As a context manager it
    closes on normal exit and cancels (which aborts an open step) on an exception. Not thread-safe.

    Sharded steps: shard 0's stream calls ``begin(batch, num_shards=S)``; each other shard's stream
    calls ``join(step_id, k)`` and then ``layer`` like shard 0 (``shard`` defaults to the joined
    shard). Each shard needs its own stream (one per thread or process): a layer call returns only
    when every shard has sent the layer. An error or abort on any shard aborts the step for all.
    """

    def __init__(self, stub: pb_grpc.AttentionStub, *, timeout: Optional[float] = None,
                 uint16_as_bf16: bool = False, metadata: Sequence[Tuple[str, str]] = ()) -> None:
        self._init_bookkeeping(stub, metadata, uint16_as_bf16)
        self._requests: "queue.Queue[Optional[pb.StepRequest]]" = queue.Queue()
        self._call = stub.Step(self._request_iterator(), timeout=timeout, metadata=self._metadata)

    def _request_iterator(self) -> Iterator[pb.StepRequest]:
        while True:
            request = self._requests.get()
            if request is None:
                return
            yield request

    def _finish(self) -> None:
        if not self._closed:
            self._closed = True
            self._step = None
            self._shard = 0
            self._requests.put(None)  # ends the request iterator (half-close)

    def _roundtrip(self, request: pb.StepRequest, expect: str) -> pb.StepResponse:
        self._check_open()
        self._requests.put(request)
        try:
            response = next(self._call)
        except grpc.RpcError as e:
            self._finish()
            raise AttndError.from_rpc_error(e) from e
        except StopIteration:
            self._finish()
            raise AttndError(grpc.StatusCode.UNKNOWN,
                             f"the server ended the Step stream instead of answering {expect!r}")
        return self._check_kind(response, expect)

    def begin(self, batch: Batch, *, write_only: bool = False, num_shards: int = 0,
              position_offsets: Optional[Sequence[int]] = None,
              query_positions: Optional[Sequence[int]] = None) -> StepInfo:
        """Opens a step over ``batch`` (none may be open on this stream); ``num_shards`` > 1 opens a
        sharded step as its shard 0; ``position_offsets`` / ``query_positions`` a context-parallel
        one (see :meth:`AttndClient.begin_step`)."""
        response = self._roundtrip(pb.StepRequest(begin=_batch(
            batch, write_only, num_shards, position_offsets, query_positions)), "begun")
        return self._opened(response.begun, batch, 0)

    def join(self, step_id: int, shard: int) -> StepInfo:
        """Attaches this stream to another shard's sharded step as shard ``shard`` (in [1, S)).
        NOT_FOUND (no such open sharded step), INVALID_ARGUMENT (shard out of range)."""
        request = pb.StepRequest(join=pb.JoinStepRequest(step_id=step_id, shard=int(shard)))
        return self._opened(self._roundtrip(request, "joined").joined, None, int(shard))

    def layer(
        self,
        layer: int,
        *,
        q_latent: Optional[TensorArg] = None,
        q_nope: Optional[TensorArg] = None,
        q_rope: Optional[TensorArg] = None,
        kv_latent: Optional[TensorArg] = None,
        k_rope: Optional[TensorArg] = None,
        index_q: Optional[TensorArg] = None,
        index_k: Optional[TensorArg] = None,
        index_w: Optional[TensorArg] = None,
        shard: Optional[int] = None,
        out: Optional[ShmTensor] = None,
        details: bool = False,
        attended: bool = False,
        lse: bool = False,
        as_torch: bool = False,
        out_datatype: Optional[str] = None,
        candidates: bool = False,
        selection: Optional[Candidates] = None,
    ):
        """Runs the open step's next layer; see :meth:`AttndClient.attend_layer` (``details``,
        ``attended``, ``lse``, ``as_torch``, ``out_datatype``, ``candidates``, ``selection`` too).
        ``shard`` defaults to the shard this stream joined as (0 after ``begin``)."""
        tensors = dict(q_latent=q_latent, q_nope=q_nope, q_rope=q_rope, kv_latent=kv_latent, k_rope=k_rope,
                       index_q=index_q, index_k=index_k, index_w=index_w)
        response = self._roundtrip(
            self._layer_request(layer, tensors, shard, out, attended, lse, out_datatype, candidates,
                                selection), "layer")
        if candidates:  # the same layer comes again, with the merged selection
            return Candidates.from_proto(response.layer.candidates)
        return self._layered(response, layer, _query(q_latent, q_nope), out, details or lse, attended, as_torch)

    def abort(self) -> None:
        """Aborts the open step (a no-op when none is open); the stream stays usable."""
        if self._step is None or self._closed:
            return
        self._roundtrip(pb.StepRequest(abort=pb.AbortStepRequest()), "aborted")
        self._aborted()

    def close(self) -> None:
        """Aborts an open step, ends the stream and waits for the server's OK."""
        if self._closed:
            return
        self.abort()
        self._finish()
        try:
            for response in self._call:
                raise AttndError(grpc.StatusCode.INTERNAL,
                                 f"Step stream: unexpected {response.WhichOneof('kind')!r} reply")
        except grpc.RpcError as e:
            raise AttndError.from_rpc_error(e) from e

    def cancel(self) -> None:
        """Cancels the RPC; the server aborts the open step. Returns once the server has released
        the open step's sequences (bounded wait), so a new step may use them at once."""
        had_step = self._step is not None and not self._closed
        self._call.cancel()
        self._finish()
        ids = self._released_ids()
        if not had_step:
            return
        deadline = time.monotonic() + 5.0
        for sid in ids:
            while time.monotonic() < deadline:
                try:
                    info = self._stub.DescribeSequence(pb.DescribeSequenceRequest(sequence_id=sid),
                                                       timeout=max(0.01, deadline - time.monotonic()),
                                                       metadata=self._metadata)
                except grpc.RpcError:
                    break
                if not info.in_step:
                    break
                time.sleep(0.002)

    def __enter__(self) -> "StepStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.cancel()


class AsyncStepStream(_StepBookkeeping):
    """The asyncio twin of :class:`StepStream`, with the same methods and arguments, awaited:
    ``await begin(batch)``, ``await layer(i, ...)`` for every layer (the last commits),
    ``await abort()``, ``await close()``; ``join`` for the other shards of a sharded step. An
    error ends the stream and aborts its open step; ``cancel()`` cancels the RPC (the server
    aborts the open step; ``await released()`` waits until it has). As an async context manager
    it closes on normal exit and cancels on an exception. One coroutine at a time per stream."""

    def __init__(self, stub: pb_grpc.AttentionStub, *, timeout: Optional[float] = None,
                 uint16_as_bf16: bool = False, metadata: Sequence[Tuple[str, str]] = ()) -> None:
        self._init_bookkeeping(stub, metadata, uint16_as_bf16)
        self._call = stub.Step(timeout=timeout, metadata=self._metadata)

    def _ended(self) -> None:
        self._closed = True
        self._aborted()

    async def _roundtrip(self, request: pb.StepRequest, expect: str) -> pb.StepResponse:
        self._check_open()
        try:
            await self._call.write(request)
            response = await self._call.read()
        except grpc.RpcError as e:
            self._ended()
            raise AttndError.from_rpc_error(e) from e
        except asyncio.InvalidStateError as e:  # the call already ended (deadline, cancel)
            self._ended()
            code = await self._call.code()
            raise AttndError(code, await self._call.details() or "the Step stream ended") from e
        except asyncio.CancelledError:
            self._ended()  # grpc.aio cancels the call with the task
            raise
        if response is grpc.aio.EOF:
            self._ended()
            code = await self._call.code()
            details = await self._call.details()
            raise AttndError(code if code != grpc.StatusCode.OK else grpc.StatusCode.UNKNOWN,
                             details or f"the server ended the Step stream instead of {expect!r}")
        return self._check_kind(response, expect)

    async def begin(self, batch: Batch, *, write_only: bool = False, num_shards: int = 0,
                    position_offsets: Optional[Sequence[int]] = None,
                    query_positions: Optional[Sequence[int]] = None) -> StepInfo:
        response = await self._roundtrip(pb.StepRequest(begin=_batch(
            batch, write_only, num_shards, position_offsets, query_positions)), "begun")
        return self._opened(response.begun, batch, 0)

    async def join(self, step_id: int, shard: int) -> StepInfo:
        request = pb.StepRequest(join=pb.JoinStepRequest(step_id=step_id, shard=int(shard)))
        return self._opened((await self._roundtrip(request, "joined")).joined, None, int(shard))

    async def layer(
        self,
        layer: int,
        *,
        q_latent: Optional[TensorArg] = None,
        q_nope: Optional[TensorArg] = None,
        q_rope: Optional[TensorArg] = None,
        kv_latent: Optional[TensorArg] = None,
        k_rope: Optional[TensorArg] = None,
        index_q: Optional[TensorArg] = None,
        index_k: Optional[TensorArg] = None,
        index_w: Optional[TensorArg] = None,
        shard: Optional[int] = None,
        out: Optional[ShmTensor] = None,
        details: bool = False,
        attended: bool = False,
        lse: bool = False,
        as_torch: bool = False,
        out_datatype: Optional[str] = None,
        candidates: bool = False,
        selection: Optional[Candidates] = None,
    ):
        """See :meth:`StepStream.layer`."""
        tensors = dict(q_latent=q_latent, q_nope=q_nope, q_rope=q_rope, kv_latent=kv_latent, k_rope=k_rope,
                       index_q=index_q, index_k=index_k, index_w=index_w)
        response = await self._roundtrip(
            self._layer_request(layer, tensors, shard, out, attended, lse, out_datatype, candidates,
                                selection), "layer")
        if candidates:  # the same layer comes again, with the merged selection
            return Candidates.from_proto(response.layer.candidates)
        return self._layered(response, layer, _query(q_latent, q_nope), out, details or lse, attended, as_torch)

    async def abort(self) -> None:
        if self._step is None or self._closed:
            return
        await self._roundtrip(pb.StepRequest(abort=pb.AbortStepRequest()), "aborted")
        self._aborted()

    async def close(self) -> None:
        """Aborts an open step, ends the stream and waits for the server's OK."""
        if self._closed:
            return
        await self.abort()
        self._closed = True
        try:
            await self._call.done_writing()
            response = await self._call.read()
            if response is not grpc.aio.EOF:
                raise AttndError(grpc.StatusCode.INTERNAL,
                                 f"Step stream: unexpected {response.WhichOneof('kind')!r} reply")
            code = await self._call.code()
        except grpc.RpcError as e:
            raise AttndError.from_rpc_error(e) from e
        if code != grpc.StatusCode.OK:
            raise AttndError(code, await self._call.details())

    def cancel(self) -> None:
        """Cancels the RPC; the server aborts the open step (see :meth:`released`)."""
        self._call.cancel()
        self._ended()

    async def released(self, timeout: float = 5.0) -> None:
        """Waits (bounded) until the server has released the last begun step's sequences after
        a cancel, so a new step may use them at once (the sync stream's cancel() does this)."""
        deadline = time.monotonic() + timeout
        for sid in self._released_ids():
            while time.monotonic() < deadline:
                try:
                    info = await self._stub.DescribeSequence(
                        pb.DescribeSequenceRequest(sequence_id=sid),
                        timeout=max(0.01, deadline - time.monotonic()), metadata=self._metadata)
                except grpc.RpcError:
                    break
                if not info.in_step:
                    break
                await asyncio.sleep(0.002)

    async def __aenter__(self) -> "AsyncStepStream":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            await self.close()
        else:
            had_step = self._step is not None
            self.cancel()
            if had_step:
                await self.released()
