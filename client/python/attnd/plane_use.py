"""How :class:`AttndClient` and :class:`AsyncAttndClient` use a data plane (docs/data-plane.md):
the mixins that connect one when the server offers it (``data_plane="auto"``), replace one that
broke, send unary layer calls through it, and the helpers both clients' Step streams finish or
abandon a call with. The plane itself, the C ABI bound with ctypes, is :mod:`attnd.data_plane`."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Optional

import grpc

from .data_plane import DataPlane, _Call, _off_loop, find_library, local_target, retry_in
from .errors import AttndError
from .v1 import attention_pb2 as pb
from .wire import LayerInputs, decode_layer, encode_layer

__all__ = ["AsyncPlaneUse", "PlaneUse", "abandon", "finish_async"]

def _attend_request(step_id: int, inputs: LayerInputs, kind: str,
                    uint16_as_bf16: bool) -> pb.AttendLayerRequest:
    """A unary layer call's request (the plane then stages its tensors)."""
    return pb.AttendLayerRequest(step_id=step_id, inputs=encode_layer(
        inputs, uint16_as_bf16=uint16_as_bf16, candidates=kind == "candidates"))


class _PlaneHolder:
    """What both clients' plane mixins share: the plane in use (``_plane_obj``)."""

    _plane_obj: Optional[DataPlane] = None

    @property
    def data_plane_name(self) -> str:
        """The connected plane's name ("ucx-3"), or "" when layer calls send bytes."""
        return self._plane_obj.name if self._plane_obj is not None else ""


class PlaneUse(_PlaneHolder):
    """The data plane in :class:`AttndClient` (a mixin): connected at the first layer call when
    the server offers one (``data_plane="auto"``), unary layer calls through it."""

    def _init_plane(self, mode: str, region_bytes: int) -> None:
        self._plane_mode, self._plane_bytes = mode, int(region_bytes)
        self._plane_lock = threading.Lock()
        self._plane_obj: Optional[DataPlane] = None
        self._plane_next_probe = 0.0  # when _plane may next ask (inf: it asked)
        self._plane_failures = 0  # probes failed in a row (each waits twice as long)

    def _close_plane(self) -> None:
        with self._plane_lock:
            self._plane_mode = "off"  # a probe under way closes what it connects
            plane, self._plane_obj = self._plane_obj, None
        self._retire(plane)

    def _retire(self, plane: Optional[DataPlane], background: bool = False) -> None:
        """Closes ``plane``'s end and asks the server to close it too (best effort, 1 s), so its
        memory goes now rather than after it stood idle; calls still holding it fail there."""
        if plane is None:
            return
        plane.close()

        def ask() -> None:
            try:
                self._stub.CloseDataPlane(pb.CloseDataPlaneRequest(plane=plane.name),
                                          metadata=self._metadata, timeout=1.0)
            except (grpc.RpcError, ValueError):  # NOT_FOUND: closed already; ValueError: closed
                pass
        if background:
            threading.Thread(target=ask, name="attnd-plane-retire", daemon=True).start()
        else:
            ask()

    def connect_data_plane(self) -> str:
        """Connects a UCX data plane now (docs/data-plane.md) and returns its name; AttndError
        FAILED_PRECONDITION when the server offers none, UNAVAILABLE when libattnd_plane.so is
        not found. With ``data_plane="auto"`` (the default) the first layer call does this by
        itself when the server offers one, and sends bytes in the message otherwise."""
        info = self._call(self._stub.ServerInfo, pb.ServerInfoRequest())
        if "ucx" not in info.data_plane.planes:
            raise AttndError(grpc.StatusCode.FAILED_PRECONDITION,
                             "the server has no UCX data plane (--data-plane=ucx)")
        try:
            plane = DataPlane(self._stub, self._metadata, info, self._plane_bytes, self._timeout,
                              local=local_target(self._target))
        except grpc.RpcError as e:
            raise AttndError.from_rpc_error(e) from e
        with self._plane_lock:
            old, self._plane_obj = self._plane_obj, plane
        self._retire(old)
        return plane.name

    def _plane(self) -> Optional[DataPlane]:
        """The plane to use now, or None (bytes). Under "auto" the first call starts connecting
        one in the background and goes as bytes itself: no layer call waits for the probe."""
        now = time.monotonic()
        broken = None
        with self._plane_lock:
            if self._plane_obj is not None and self._plane_obj.broken:
                broken, self._plane_obj = self._plane_obj, None  # connect a new one
                self._plane_next_probe = now
            plane = self._plane_obj
            probe = plane is None and self._plane_mode == "auto" and now >= self._plane_next_probe
            if probe:
                self._plane_next_probe = float("inf")  # one probe at a time
        self._retire(broken, background=True)
        if not probe:
            return plane
        if find_library() is None:
            return None
        threading.Thread(target=self._probe_plane, name="attnd-plane-probe", daemon=True).start()
        return None

    def _probe_plane(self) -> None:
        try:
            info = self._stub.ServerInfo(pb.ServerInfoRequest(), metadata=self._metadata,
                                         timeout=2.0)
            if "ucx" in info.data_plane.planes and self._plane_mode == "auto":
                self.connect_data_plane()
                self._plane_failures = 0
        except (AttndError, grpc.RpcError, ValueError):  # ValueError: the channel closed
            with self._plane_lock:
                self._plane_next_probe = time.monotonic() + retry_in(self._plane_failures)
                self._plane_failures += 1
        if self._plane_mode != "auto":  # closed meanwhile
            self._close_plane()

    def _attend(self, step_id: int, inputs: LayerInputs, kind: str):
        plane = self._plane()
        if plane is None:
            return super()._attend(step_id, inputs, kind)
        request = _attend_request(step_id, inputs, kind, self._uint16_as_bf16)
        call = plane.stage(request.inputs)
        try:
            reply = self._call(self._stub.AttendLayer, request)
        except BaseException as e:
            plane.failed(e)  # first: a call whose outcome is unknown keeps its space
            plane.finish(call, None)
            raise
        plane.finish(call, reply.output)
        return decode_layer(reply.output, inputs, self._uint16_as_bf16, kind)


async def finish_async(plane: DataPlane, call: Optional[_Call], out: pb.LayerOutput) -> None:
    """:meth:`DataPlane.finish` from an event loop: the wait for the output runs in a worker
    thread (ctypes lets go of the GIL), so the loop serves other calls meanwhile."""
    if call is not None:
        await asyncio.to_thread(plane.finish, call, out)


def abandon(plane: DataPlane, call: Optional[_Call], error: BaseException) -> None:
    """A call over the plane failed (or its task was cancelled): its space is given back once
    its send settles, in a worker thread, and the plane learns whether it broke."""
    plane.failed(error)  # first: a call whose outcome is unknown keeps its space
    if call is not None:
        threading.Thread(target=plane.finish, args=(call, None), name="attnd-plane-abandon",
                         daemon=True).start()


class AsyncPlaneUse(_PlaneHolder):
    """The data plane in :class:`AsyncAttndClient` (a mixin), as :class:`PlaneUse` does it for
    the sync client: under ``data_plane="auto"`` the first layer call starts connecting one in
    the background (a task on the loop) and goes as bytes itself."""

    def _init_plane(self, mode: str, region_bytes: int) -> None:
        self._plane_mode, self._plane_bytes = mode, int(region_bytes)
        self._plane_obj: Optional[DataPlane] = None
        self._plane_next_probe = 0.0  # when _plane may next ask (inf: it asked)
        self._plane_failures = 0  # probes failed in a row (each waits twice as long)
        self._plane_task: Optional[asyncio.Task] = None
        self._plane_retiring: set = set()  # tasks closing broken planes on the server

    async def _aclose_plane(self) -> None:
        """The client is closing: a probe under way ends before the channel does, and the plane
        is closed on the server too."""
        task, self._plane_task = self._plane_task, None
        self._plane_mode = "off"
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        plane, self._plane_obj = self._plane_obj, None
        await self._aretire(plane)
        for t in list(self._plane_retiring):
            await t

    async def _aretire(self, plane: Optional[DataPlane]) -> None:
        """As :meth:`PlaneUse._retire`, awaited."""
        if plane is None:
            return
        await _off_loop(plane.close)  # waits for this end's thread (and transfers, 200 ms)
        try:
            await self._stub.CloseDataPlane(pb.CloseDataPlaneRequest(plane=plane.name),
                                            metadata=self._metadata, timeout=1.0)
        except (grpc.RpcError, ValueError):  # NOT_FOUND: closed already
            pass

    async def connect_data_plane(self) -> str:
        """See :meth:`AttndClient.connect_data_plane`."""
        info = await self._unary("ServerInfo", pb.ServerInfoRequest(), lambda r: r)
        if "ucx" not in info.data_plane.planes:
            raise AttndError(grpc.StatusCode.FAILED_PRECONDITION,
                             "the server has no UCX data plane (--data-plane=ucx)")
        try:
            plane = await DataPlane.connect_async(self._stub, self._metadata, info,
                                                  self._plane_bytes, self._timeout,
                                                  local=local_target(self._target))
        except grpc.RpcError as e:
            raise AttndError.from_rpc_error(e) from e
        old, self._plane_obj = self._plane_obj, plane
        await self._aretire(old)
        return plane.name

    def _plane(self) -> Optional[DataPlane]:
        now = time.monotonic()
        if self._plane_obj is not None and self._plane_obj.broken:
            broken, self._plane_obj, self._plane_next_probe = self._plane_obj, None, now
            try:  # closed on the server in the background (from a coroutine)
                t = asyncio.get_running_loop().create_task(self._aretire(broken))
                self._plane_retiring.add(t)
                t.add_done_callback(self._plane_retiring.discard)
            except RuntimeError:
                broken.close()
        if (self._plane_obj is not None or self._plane_mode != "auto"
                or now < self._plane_next_probe or find_library() is None):
            return self._plane_obj
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not from a coroutine: the next call asks
            return None
        self._plane_next_probe = float("inf")  # one probe at a time
        self._plane_task = loop.create_task(self._probe_plane())
        return None

    async def _probe_plane(self) -> None:
        try:
            info = await self._stub.ServerInfo(pb.ServerInfoRequest(), metadata=self._metadata,
                                               timeout=2.0)
            if "ucx" in info.data_plane.planes and self._plane_mode == "auto":
                await self.connect_data_plane()
                self._plane_failures = 0
        except (AttndError, grpc.RpcError, ValueError):
            self._plane_next_probe = time.monotonic() + retry_in(self._plane_failures)
            self._plane_failures += 1
        if self._plane_mode != "auto":  # closed meanwhile: what this connected goes too
            plane, self._plane_obj = self._plane_obj, None
            await self._aretire(plane)

    async def _attend(self, step_id: int, inputs: LayerInputs, kind: str):
        plane = self._plane()
        if plane is None:
            return await super()._attend(step_id, inputs, kind)
        request = _attend_request(step_id, inputs, kind, self._uint16_as_bf16)
        call = plane.stage(request.inputs)
        try:
            reply = await self._unary("AttendLayer", request, lambda r: r)
        except BaseException as e:
            abandon(plane, call, e)
            raise
        await finish_async(plane, call, reply.output)
        return decode_layer(reply.output, inputs, self._uint16_as_bf16, kind)
