"""Shared memory (a client on the server's host): :class:`ShmArena` (a POSIX shared-memory
object carved into slots) and :class:`ShmTensor` (a reference into a registered region)."""

from __future__ import annotations

import dataclasses
import os
import sys
from multiprocessing import resource_tracker, shared_memory
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from .errors import AttndError
from .tensors import Fp8Tensor, _check_dtype, _native, _wire_name, as_numpy, to_torch
from .v1 import attention_pb2 as pb

if TYPE_CHECKING:
    from .client import AttndClient

__all__ = ["ShmArena", "ShmTensor", "TensorArg"]


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
    arena: Optional[ShmArena] = dataclasses.field(default=None, compare=False, repr=False)

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
TensorArg = Union[np.ndarray, ShmTensor, Fp8Tensor]


class ShmArena:
    """A POSIX shared-memory object (``multiprocessing.shared_memory``) carved into aligned slots.

    ``ShmArena(size)`` creates the object (``name`` defaults to a fresh "attnd-<pid>-<hex>";
    ``/dev/shm/<name>`` on Linux); :meth:`attach` (or ``create=False``, ``size`` then ignored)
    maps an existing one, e.g. another process's. Its key for RegisterSharedMemory is ``"/" +
    name``; :meth:`register`
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
        self._clients: List[AttndClient] = []
        self._unmapped: Optional[shared_memory.SharedMemory] = None  # closed, not yet unmapped

    @classmethod
    def attach(cls, name: str, *, region: Optional[str] = None, alignment: int = 64
               ) -> ShmArena:
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

    def register(self, client: AttndClient) -> None:
        """Registers the whole object as region ``region`` with ``client``'s server (once per
        server); close() unregisters it. A sync :class:`AttndClient` (close() must unregister
        without an event loop); with an async client, ``await client.register_shared_memory(
        arena.region, arena.key, arena.size)`` and unregister it yourself."""
        from .client import AttndClient  # the client module imports this one

        if not isinstance(client, AttndClient):
            raise TypeError("ShmArena.register takes an AttndClient (for an AsyncAttndClient: "
                            "await client.register_shared_memory(arena.region, arena.key, "
                            "arena.size))")
        client.register_shared_memory(self.region, self.key, self.size)
        self._clients.append(client)

    def unregister(self, client: AttndClient) -> None:
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

    def __enter__(self) -> ShmArena:
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
