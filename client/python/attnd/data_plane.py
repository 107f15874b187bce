"""The UCX data plane from Python (docs/data-plane.md): the C ABI of attnd's client end
(``libattnd_plane.so``, built with attnd) bound with ctypes. :class:`DataPlane` moves a layer
call's tensors into the server's input region and its output back, so the message carries only
their names; :class:`AttndClient` and :class:`AsyncAttndClient` use it by themselves when the
server offers a plane (``data_plane="auto"``) and send bytes in the message otherwise.

The library is found at $ATTND_PLANE_LIB, else next to this package, else in the source tree's
``build/transport``, else on the library path (``cmake --install`` puts it in the lib folder);
without it the client sends bytes (no error)."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import threading
from pathlib import Path
from typing import List, Optional

import grpc

from .errors import AttndError, _StreamClosed
from .v1 import attention_pb2 as pb

__all__ = ["DataPlane", "find_library"]

_FIELDS = ("q_latent", "q_nope", "q_rope", "kv_latent", "k_rope", "index_q", "index_k",
           "index_w")
_SIZES = {"BF16": 2, "FP16": 2, "FP32": 4}
_SETTLE_S = 5.0  # beyond the reply, for the sends and the output (the server already waited)
_lib_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None


def find_library() -> Optional[Path]:
    """Where libattnd_plane.so is (see the module's text), or None."""
    candidates = []
    if os.environ.get("ATTND_PLANE_LIB"):
        candidates.append(Path(os.environ["ATTND_PLANE_LIB"]))
    here = Path(__file__).resolve().parent
    candidates += [here / "libattnd_plane.so",
                   here.parents[2] / "build" / "transport" / "libattnd_plane.so"]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:  # installed with attnd (cmake --install): on the library path
        name = ctypes.util.find_library("attnd_plane")
        found = Path(name) if name else None
    return found


# Status codes after which a call's outcome on the server is unknown (see DataPlane.failed).
_UNKNOWN_OUTCOME = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN)
_load_error = [""]  # why a found library did not load, for the error that says so


def _load() -> Optional[ctypes.CDLL]:
    global _lib
    with _lib_lock:
        if _lib is None:
            path = find_library()
            if path is None:
                return None
            try:
                lib = ctypes.CDLL(str(path) if path.is_absolute() else path.name)
            except OSError as e:  # found, but not loadable here (its UCX libraries missing)
                _load_error[0] = f"{path}: {e}"
                return None
            c_i64, c_u64 = ctypes.c_int64, ctypes.c_uint64
            c_sz, c_p = ctypes.c_size_t, ctypes.c_void_p
            err = [ctypes.c_char_p, c_sz]
            # Absent from a library built before it (DataPlane then uses attnd_plane_create:
            # its UCX on every interface).
            if hasattr(lib, "attnd_plane_create_for"):
                f = lib.attnd_plane_create_for
                f.restype, f.argtypes = c_p, [c_i64, ctypes.c_int, *err]
            # Absent from a library built before them (the server is then not given this end's
            # address, and every output is pulled).
            if all(hasattr(lib, n) for n in _PUSH_FUNCTIONS):
                for name, res, args in [
                    ("attnd_plane_address", None,
                     [c_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(c_sz)]),
                    ("attnd_plane_attach_with", ctypes.c_int,
                     [c_p, c_u64, ctypes.c_char_p, c_sz, ctypes.c_char_p, c_sz, c_i64,
                      ctypes.c_int, *err]),
                    ("attnd_plane_want", None, [c_p, c_u64]),
                ]:
                    f = getattr(lib, name)
                    f.restype, f.argtypes = res, args
            if hasattr(lib, "attnd_plane_keepalive"):  # absent before keepalives
                lib.attnd_plane_keepalive.restype = None
                lib.attnd_plane_keepalive.argtypes = [c_p, c_i64]
            if hasattr(lib, "attnd_plane_lost"):  # absent in older libraries
                lib.attnd_plane_lost.restype = ctypes.c_int
                lib.attnd_plane_lost.argtypes = [c_p]
            for name, res, args in [
                ("attnd_plane_create", c_p, [c_i64, *err]),
                ("attnd_plane_destroy", None, [c_p]),
                ("attnd_plane_attach", ctypes.c_int,
                 [c_p, c_u64, ctypes.c_char_p, c_sz, ctypes.c_char_p, c_sz, c_i64, *err]),
                ("attnd_plane_take_input", c_i64, [c_p, c_i64]),
                ("attnd_plane_give_input", None, [c_p, c_i64]),
                ("attnd_plane_take_output", c_i64, [c_p, c_i64]),
                ("attnd_plane_give_output", None, [c_p, c_i64]),
                ("attnd_plane_next_transfer", c_u64, [c_p]),
                ("attnd_plane_put", c_p,
                 [c_p, ctypes.POINTER(c_p), ctypes.POINTER(c_sz), c_sz, c_i64, c_u64]),
                ("attnd_plane_wait", ctypes.c_int, [c_p, ctypes.c_double, *err]),
                ("attnd_plane_await", ctypes.c_int,
                 [c_p, c_u64, c_i64, c_sz, ctypes.c_double, ctypes.POINTER(ctypes.c_void_p),
                  *err]),
                ("attnd_plane_forget", None, [c_p, c_u64]),
            ]:
                f = getattr(lib, name)
                f.restype, f.argtypes = res, args
            _lib = lib
        return _lib


_PUSH_FUNCTIONS = ("attnd_plane_address", "attnd_plane_attach_with", "attnd_plane_want")


def _check(rc: int, err: ctypes.Array, what: str) -> None:
    if rc != 0:
        code = next((c for c in grpc.StatusCode if c.value[0] == rc), grpc.StatusCode.UNKNOWN)
        raise AttndError(code, f"{what}: {err.value.decode(errors='replace')}")


def retry_in(failures: int) -> float:
    """Seconds before asking again for a plane after `failures` failed probes in a row: 10,
    twice as long after each failure, at most ten minutes (a server whose UCX is out of reach
    is not asked every 10 s for good)."""
    return min(10.0 * 2 ** min(failures, 6), 600.0)


def _unavailable():
    return grpc.StatusCode.UNAVAILABLE


async def _off_loop(fn, *args):
    """``fn(*args)`` in a worker thread (ctypes lets go of the GIL); a cancel propagates once it
    has ended, so that what it made is there for the caller to clean up."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        # The thread runs on whatever is cancelled: wait for it, through further cancels too
        # (each shielded: a cancelled to_thread future ends at once, its thread still running).
        while not work.done():
            try:
                await asyncio.wait({work})
            except asyncio.CancelledError:
                pass
        if not work.cancelled():
            work.exception()  # seen: the cancel is what the caller hears of
        raise


class _Call:
    """One layer call's use of the plane: what to wait for and give back."""

    def __init__(self) -> None:
        self.keep: List[bytes] = []  # the sent bytes, alive until the send is done
        self.send = None
        self.input_offset = -1
        self.output_offset = -1
        self.output_transfer = 0
        self.output_bytes = 0


def local_target(target: str) -> bool:
    """Whether gRPC target ``target`` reaches this host only: a Unix socket, localhost,
    127.0.0.0/8 or ::1 (with or without a dns:, ipv4: or ipv6: scheme). A plane to such a server
    keeps this end's UCX on the loopback interfaces (UCX's TCP transport listens on every
    interface otherwise, and a host that reaches it can write this process's memory:
    docs/trust.md). As the C++ client's IsLocalTarget."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            break
    host = target
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    dotted = bool(host) and all(c == "." or c.isdigit() for c in host)
    return host in ("localhost", "::1") or (dotted and host.startswith("127."))


class DataPlane:
    """A connected plane (ConnectDataPlane over ``stub``): ``stage`` a layer message before it
    goes, ``finish`` its reply after. Thread-safe."""

    def __init__(self, stub, metadata, info: pb.ServerInfoResponse, region_bytes: int,
                 timeout: Optional[float] = None, local: bool = False) -> None:
        request = self._create(info, region_bytes, local)
        reply = stub.ConnectDataPlane(request, metadata=metadata, timeout=timeout)
        try:
            self._attach(reply, info)
        except BaseException:
            # This end cannot reach the server's (its UCX port out of reach): the plane the
            # server made is closed now rather than left to stand silent until it is reaped.
            try:
                stub.CloseDataPlane(pb.CloseDataPlaneRequest(plane=reply.plane),
                                    metadata=metadata, timeout=1.0)
            except (grpc.RpcError, ValueError):
                pass
            raise

    @classmethod
    async def connect_async(cls, stub, metadata, info: pb.ServerInfoResponse, region_bytes: int,
                            timeout: Optional[float] = None, local: bool = False) -> DataPlane:
        """The plane over a grpc.aio ``stub`` (for :class:`AsyncAttndClient`). Making this end
        (UCX's start-up), attaching it (up to 5 s for a server whose UCX port does not answer)
        and a failed try's teardown run in worker threads: the loop serves other calls."""
        plane = cls.__new__(cls)
        plane._p = None
        try:
            request = await _off_loop(plane._create, info, region_bytes, local)
            reply = await stub.ConnectDataPlane(request, metadata=metadata, timeout=timeout)
        except BaseException:
            if plane._p:
                await _off_loop(plane.close)
            raise
        try:
            await _off_loop(plane._attach, reply, info)
        except BaseException:
            await _off_loop(plane.close)
            try:  # as __init__ does
                await stub.CloseDataPlane(pb.CloseDataPlaneRequest(plane=reply.plane),
                                          metadata=metadata, timeout=1.0)
            except (grpc.RpcError, ValueError):
                pass
            raise
        return plane

    def _create(self, info: pb.ServerInfoResponse, region_bytes: int,
                local: bool) -> pb.ConnectDataPlaneRequest:
        """This end (its worker and output region; its UCX on loopback only when ``local``: the
        server is on this host); returns the handshake's request."""
        self._p = None
        # Calls between stage and finish: close() while any is under way leaves the last one's
        # finish to destroy this end (a call's waits and give-backs use it to the end).
        self._lock, self._calls, self._closing = threading.Lock(), 0, False
        lib = _load()
        if lib is None:
            raise AttndError(_unavailable(), "libattnd_plane.so not found" if not _load_error[0]
                             else f"libattnd_plane.so cannot be loaded: {_load_error[0]}")
        self._lib = lib
        self._size = min(int(region_bytes), int(info.data_plane.max_region_bytes))
        err = ctypes.create_string_buffer(512)
        if hasattr(lib, "attnd_plane_create_for"):
            self._p = lib.attnd_plane_create_for(self._size, int(local), err, len(err))
        else:
            self._p = lib.attnd_plane_create(self._size, err, len(err))
        if not self._p:
            raise AttndError(_unavailable(), err.value.decode(errors="replace"))
        request = pb.ConnectDataPlaneRequest(input_bytes=self._size, output_bytes=self._size)
        if all(hasattr(lib, n) for n in _PUSH_FUNCTIONS):
            # Given this end's address, the server sends each output as soon as it is built.
            at, n = ctypes.c_void_p(), ctypes.c_size_t()
            lib.attnd_plane_address(self._p, ctypes.byref(at), ctypes.byref(n))
            request.worker_address = ctypes.string_at(at, n.value)
        # This end then says it lives as often as the reply asks, so that the server closes the
        # plane soon after this process dies (rather than after ten idle minutes).
        request.sends_keepalives = hasattr(lib, "attnd_plane_keepalive")
        return request

    def _attach(self, reply: pb.ConnectDataPlaneResponse, info: pb.ServerInfoResponse) -> None:
        """Connects this end to the server's, as the handshake's ``reply`` says."""
        lib, err = self._lib, ctypes.create_string_buffer(512)
        # Outputs come unasked from a server that took this end's address (the request gave it
        # only where the library has these functions).
        self.pushes = bool(reply.pushes_outputs)
        if self.pushes:
            rc = lib.attnd_plane_attach_with(
                self._p, reply.plane_id, reply.token, len(reply.token), reply.worker_address,
                len(reply.worker_address), self._size, 1, err, len(err))
        else:
            rc = lib.attnd_plane_attach(self._p, reply.plane_id, reply.token, len(reply.token),
                                        reply.worker_address, len(reply.worker_address),
                                        self._size, err, len(err))
        _check(rc, err, "data plane")
        if reply.keepalive_ms > 0 and hasattr(lib, "attnd_plane_keepalive"):
            lib.attnd_plane_keepalive(self._p, reply.keepalive_ms)
        self.name = reply.plane
        self.plane_id, self.server_address = reply.plane_id, reply.worker_address
        self.broken = False  # True once the plane can carry no more calls (see failed)
        self._in, self._out = reply.input_region, reply.output_region
        self._latent = info.model.kv_lora_rank
        self._v = info.absorption.v_head_dim if info.HasField("absorption") else 0

    def close(self) -> None:
        if not getattr(self, "_p", None):
            return  # never made (or closed)
        with self._lock:
            self._closing = True
            if self._calls:
                return  # the last call's finish destroys it
            p, self._p = self._p, None
        if p:
            self._lib.attnd_plane_destroy(p)

    def _release(self) -> None:
        """One call is done with this end."""
        with self._lock:
            self._calls -= 1
            if not (self._closing and self._calls == 0):
                return
            p, self._p = self._p, None
        if p:
            self._lib.attnd_plane_destroy(p)

    def __del__(self) -> None:
        self.close()

    def failed(self, error: BaseException) -> None:
        """A call over the plane failed with ``error``: when it says the server holds the plane
        no more (closed, or idle too long), the plane is broken and the client replaces it; so
        it is when the call's outcome on the server is unknown (the client gave up: a deadline,
        a cancelled task; or the connection failed), since the server may still be using the
        call's space, which must then go to no other call. A stream closed before the call was
        sent (:class:`_StreamClosed`) tells it nothing."""
        if isinstance(error, _StreamClosed):
            return
        text = str(error)
        if f"no data plane region {self.name}." in text or f"data plane {self.name} was closed" \
                in text:
            self.broken = True
        if isinstance(error, AttndError):
            code = error.code
        elif isinstance(error, grpc.RpcError) and callable(getattr(error, "code", None)):
            code = error.code()
        else:
            code = None  # not the server's answer (a cancelled task, an interrupt)
        if code is None or code in _UNKNOWN_OUTCOME:
            self.broken = True

    def stage(self, msg: pb.LayerInputs) -> Optional[_Call]:
        """Moves ``msg``'s tensor bytes into the plane (one transfer) and asks for the output in
        the output region; None (msg untouched) when the regions cannot take them now or the
        plane is broken or closed."""
        if self.broken:
            return None
        with self._lock:
            if self._closing or not self._p:
                return None
            if hasattr(self._lib, "attnd_plane_lost") and self._lib.attnd_plane_lost(self._p):
                self.broken = True  # its endpoint failed: this call goes as bytes, the next
                return None  # connects a new plane (a call sent naming it would wait in vain)
            self._calls += 1
        call = _Call()
        try:
            staged = self._stage(msg, call)
        except BaseException:
            # An interrupt part-way (the message is not sent): a send already under way still
            # reads call.keep, and the space it took is given back only once it settled.
            self.finish(call, None)
            raise
        if staged is None:
            self._release()
        return staged

    def _stage(self, msg: pb.LayerInputs, call: _Call) -> Optional[_Call]:
        refs, total = [], 0
        for name in _FIELDS:
            if not msg.HasField(name):
                continue
            t = getattr(msg, name)
            if t.HasField("shm") or not t.data:
                continue
            data = t.data
            refs.append((t, total, len(data)))
            call.keep.append(data)
            total += len(data)
        out_bytes = self._output_bytes(msg)
        if total == 0 and out_bytes == 0:
            return None
        lib, p = self._lib, self._p
        if total > 0:
            call.input_offset = lib.attnd_plane_take_input(p, total)
            if call.input_offset < 0:
                return None
        if out_bytes > 0:
            call.output_offset = lib.attnd_plane_take_output(p, out_bytes)
            if call.output_offset >= 0:
                call.output_transfer = lib.attnd_plane_next_transfer(p)
                if self.pushes:
                    lib.attnd_plane_want(p, call.output_transfer)
                call.output_bytes = out_bytes
                msg.out_shm.region, msg.out_shm.offset = self._out, call.output_offset
                msg.out_shm.byte_size, msg.out_shm.transfer = out_bytes, call.output_transfer
        if total > 0:
            transfer = lib.attnd_plane_next_transfer(p)
            pieces = (ctypes.c_void_p * len(refs))(
                *[ctypes.cast(ctypes.c_char_p(d), ctypes.c_void_p) for d in call.keep])
            lengths = (ctypes.c_size_t * len(refs))(*[n for _, _, n in refs])
            call.send = lib.attnd_plane_put(p, pieces, lengths, len(refs), call.input_offset,
                                            transfer)
            for t, off, n in refs:
                t.ClearField("data")
                t.shm.region, t.shm.offset = self._in, call.input_offset + off
                t.shm.byte_size, t.shm.transfer = n, transfer
        return call

    def finish(self, call: Optional[_Call], out: Optional[pb.LayerOutput]) -> None:
        """After the reply (``out``; None when the call failed, after :meth:`failed`): waits for
        the send, puts an output the plane carried into ``out.out.data`` and gives the call's
        space back (unless the plane broke)."""
        if call is None:
            return
        lib, p = self._lib, self._p
        err = ctypes.create_string_buffer(512)
        try:
            if call.send is not None:
                send, call.send = call.send, None
                rc = lib.attnd_plane_wait(send, _SETTLE_S, err, len(err))
                if rc != 0:
                    self.broken = True  # a send that never completed closed the endpoint
                    _check(rc, err, "data plane")
            if (out is not None and call.output_offset >= 0 and out.out.HasField("shm")
                    and out.out.shm.region == self._out):
                where = ctypes.c_void_p()
                rc = lib.attnd_plane_await(p, call.output_transfer, call.output_offset,
                                           call.output_bytes, _SETTLE_S, ctypes.byref(where), err,
                                           len(err))
                if rc not in (0, grpc.StatusCode.NOT_FOUND.value[0]):
                    self.broken = True  # the endpoint failed, or the output never came
                _check(rc, err, "data plane")
                out.out.data = ctypes.string_at(where, call.output_bytes)
                out.out.ClearField("shm")
                call.output_transfer = 0
        finally:
            if call.send is not None:  # an error above: the send must still be waited for
                lib.attnd_plane_wait(call.send, _SETTLE_S, err, len(err))
            if call.output_transfer:
                lib.attnd_plane_forget(p, call.output_transfer)
            # A broken plane takes no more calls, and the server may still be using a failed
            # call's space (its outcome unknown: see failed): that space goes to no other call.
            if call.input_offset >= 0 and not self.broken:
                lib.attnd_plane_give_input(p, call.input_offset)
            if call.output_offset >= 0 and not self.broken:
                lib.attnd_plane_give_output(p, call.output_offset)
            call.keep.clear()
            self._release()

    def _output_bytes(self, msg: pb.LayerInputs) -> int:
        """The output's size when the reply would carry it and it is known here, else 0."""
        if msg.HasField("out_shm") or not (msg.HasField("q_latent") or msg.HasField("q_nope")):
            return 0
        q = msg.q_nope if msg.HasField("q_nope") else msg.q_latent
        width = self._v if msg.HasField("q_nope") else self._latent
        dtype = msg.out_datatype or ("BF16" if q.datatype == "FP8_E4M3" else q.datatype)
        if dtype not in _SIZES or len(q.shape) != 3 or width <= 0:
            return 0
        return int(q.shape[0]) * int(q.shape[1]) * width * _SIZES[dtype]
