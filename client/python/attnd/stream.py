"""Step streams: one bidirectional ``Step`` RPC carrying many steps — :class:`StepStream`
(blocking) and :class:`AsyncStepStream` (asyncio)."""

from __future__ import annotations

import asyncio
import queue
import time
from typing import Iterator, List, Optional, Sequence, Tuple

import grpc

from . import wire
from .errors import AttndError, _StreamClosed
from .plane_use import abandon, finish_async
from .sync import run_sync
from .types import Batch, Candidates, LayerResult, StepInfo
from .v1 import attention_pb2 as pb
from .v1 import attention_pb2_grpc as pb_grpc
from .wire import LayerInputs, LayerOutput

__all__ = ["AsyncStepStream", "StepStream"]


async def _await_released(ids, timeout: float, describe, sleep) -> None:
    """Until no sequence of ``ids`` is in a step on the server (or ``timeout`` seconds): the wait
    after a cancel, for both streams (``describe`` and ``sleep`` sync or awaited)."""
    deadline = time.monotonic() + timeout
    for sid in ids:
        while time.monotonic() < deadline:
            try:
                info = await describe(pb.DescribeSequenceRequest(sequence_id=sid),
                                      max(0.01, deadline - time.monotonic()))
            except grpc.RpcError:
                break
            if not info.in_step:
                break
            await sleep(0.002)


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
            raise _StreamClosed("the step stream is closed; open a new one with client.stream()")

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

    def _layer_request(self, inputs: LayerInputs, kind: str) -> pb.StepRequest:
        return pb.StepRequest(layer=wire.encode_layer(
            inputs, uint16_as_bf16=self._uint16_as_bf16, default_shard=self._shard,
            candidates=kind == "candidates"))

    def _layered(self, response: pb.StepResponse, inputs: LayerInputs, kind: str):
        if kind != "candidates":  # a candidates call leaves the layer to come again
            self._next_layer = int(inputs.layer) + 1
            if response.layer.committed:
                self._step, self._shard = None, 0
        return wire.decode_layer(response.layer, inputs, self._uint16_as_bf16, kind)

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
    error (raised as :class:`AttndError`) ends the stream and aborts its open step; open a new
    stream
    to go on. ``close()`` aborts an open step and ends the stream cleanly. As a context manager it
    closes on normal exit and cancels (which aborts an open step) on an exception. Not thread-safe.

    Sharded steps: shard 0's stream calls ``begin(batch, num_shards=S)``; each other shard's stream
    calls ``join(step_id, k)`` and then ``layer`` like shard 0 (``shard`` defaults to the joined
    shard). Each shard needs its own stream (one per thread or process): a layer call returns only
    when every shard has sent the layer. An error or abort on any shard aborts the step for all.
    """

    def __init__(self, stub: pb_grpc.AttentionStub, *, timeout: Optional[float] = None,
                 uint16_as_bf16: bool = False, metadata: Sequence[Tuple[str, str]] = (),
                 plane=None) -> None:
        self._init_bookkeeping(stub, metadata, uint16_as_bf16)
        # Layer tensors travel through the plane this gives at each call (docs/data-plane.md):
        # the client's current one, connected or replaced since the stream opened; or a
        # DataPlane, or None.
        self._planes = plane if callable(plane) else lambda: plane
        self._requests: queue.Queue[Optional[pb.StepRequest]] = queue.Queue()
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
                             f"the server ended the Step stream instead of answering {expect!r}"
                             ) from None
        return self._check_kind(response, expect)

    def begin(self, batch: Batch, *, write_only: bool = False, num_shards: int = 0,
              position_offsets: Optional[Sequence[int]] = None,
              query_positions: Optional[Sequence[int]] = None,
              block_hashes: Optional[Sequence[Sequence[bytes]]] = None,
              generations: Optional[Sequence[int]] = None,
              starts: Optional[Sequence[Optional[int]]] = None) -> StepInfo:
        """Opens a step over ``batch`` (none may be open on this stream); ``num_shards`` > 1 opens a
        sharded step as its shard 0; ``position_offsets`` / ``query_positions`` a context-parallel
        one (see :meth:`AttndClient.begin_step`)."""
        response = self._roundtrip(pb.StepRequest(begin=wire._batch(
            batch, write_only, num_shards, position_offsets, query_positions, block_hashes,
            generations, starts)),
            "begun")
        return self._opened(response.begun, batch, 0)

    def join(self, step_id: int, shard: int) -> StepInfo:
        """Attaches this stream to another shard's sharded step as shard ``shard`` (in [1, S)).
        NOT_FOUND (no such open sharded step), INVALID_ARGUMENT (shard out of range)."""
        request = pb.StepRequest(join=pb.JoinStepRequest(step_id=step_id, shard=int(shard)))
        return self._opened(self._roundtrip(request, "joined").joined, None, int(shard))

    def layer(self, inputs: Optional[LayerInputs] = None, **legacy) -> LayerOutput:
        """Runs the open step's next layer with ``inputs``; returns its output, as
        :meth:`AttndClient.attend_layer` does (``inputs.shard`` None: the shard this stream joined
        as, 0 after ``begin``). :meth:`layer_details` returns a :class:`LayerResult`,
        :meth:`layer_candidates` :class:`Candidates`. The keyword form of the previous release,
        ``layer(i, q_latent=..., ...)``, still works for one release, with a DeprecationWarning
        (see :meth:`AttndClient.attend_layer`)."""
        inputs, kind = wire.layer_call("layer", inputs, legacy)
        if kind == "output":
            wire.check_output_call(inputs, "layer")
        return self._layer(inputs, kind)

    def layer_details(self, inputs: LayerInputs) -> LayerResult:
        """:meth:`layer`, returning a :class:`LayerResult` (see
        :meth:`AttndClient.attend_layer_details`)."""
        return self._layer(inputs, "details")

    def layer_candidates(self, inputs: LayerInputs) -> Candidates:
        """A context-parallel full layer's candidates (see
        :meth:`AttndClient.attend_layer_candidates`); the same layer then comes again."""
        return self._layer(inputs, "candidates")

    def _layer(self, inputs: LayerInputs, kind: str):
        # A closed stream stages nothing: its refusal is no failure of the shared plane.
        self._check_open()
        request = self._layer_request(inputs, kind)
        plane = self._planes()
        call = plane.stage(request.layer) if plane is not None else None
        try:
            response = self._roundtrip(request, "layer")
        except BaseException as e:
            if call is not None:
                plane.failed(e)  # first: a call whose outcome is unknown keeps its space
                plane.finish(call, None)
            raise
        if call is not None:
            plane.finish(call, response.layer)
        return self._layered(response, inputs, kind)

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

        async def describe(request, timeout):
            return self._stub.DescribeSequence(request, timeout=timeout, metadata=self._metadata)

        async def sleep(seconds):
            time.sleep(seconds)
        run_sync(_await_released(ids, 5.0, describe, sleep))

    def __enter__(self) -> StepStream:
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
                 uint16_as_bf16: bool = False, metadata: Sequence[Tuple[str, str]] = (),
                 plane=None) -> None:
        self._init_bookkeeping(stub, metadata, uint16_as_bf16)
        self._planes = plane if callable(plane) else lambda: plane  # as for StepStream
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
                    query_positions: Optional[Sequence[int]] = None,
                    block_hashes: Optional[Sequence[Sequence[bytes]]] = None,
                    generations: Optional[Sequence[int]] = None,
                    starts: Optional[Sequence[Optional[int]]] = None) -> StepInfo:
        response = await self._roundtrip(pb.StepRequest(begin=wire._batch(
            batch, write_only, num_shards, position_offsets, query_positions, block_hashes,
            generations, starts)),
            "begun")
        return self._opened(response.begun, batch, 0)

    async def join(self, step_id: int, shard: int) -> StepInfo:
        request = pb.StepRequest(join=pb.JoinStepRequest(step_id=step_id, shard=int(shard)))
        return self._opened((await self._roundtrip(request, "joined")).joined, None, int(shard))

    async def layer(self, inputs: Optional[LayerInputs] = None, **legacy) -> LayerOutput:
        """See :meth:`StepStream.layer` (the keyword form too, deprecated)."""
        inputs, kind = wire.layer_call("layer", inputs, legacy)
        if kind == "output":
            wire.check_output_call(inputs, "layer")
        return await self._layer(inputs, kind)

    async def layer_details(self, inputs: LayerInputs) -> LayerResult:
        """See :meth:`StepStream.layer_details`."""
        return await self._layer(inputs, "details")

    async def layer_candidates(self, inputs: LayerInputs) -> Candidates:
        """See :meth:`StepStream.layer_candidates`."""
        return await self._layer(inputs, "candidates")

    async def _layer(self, inputs: LayerInputs, kind: str):
        self._check_open()  # as StepStream._layer
        request = self._layer_request(inputs, kind)
        plane = self._planes()
        call = plane.stage(request.layer) if plane is not None else None
        try:
            response = await self._roundtrip(request, "layer")
        except BaseException as e:
            if call is not None:
                abandon(plane, call, e)
            raise
        if call is not None:
            await finish_async(plane, call, response.layer)
        return self._layered(response, inputs, kind)

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

        async def describe(request, timeout):
            return await self._stub.DescribeSequence(request, timeout=timeout,
                                                     metadata=self._metadata)
        await _await_released(self._released_ids(), timeout, describe, asyncio.sleep)

    async def __aenter__(self) -> AsyncStepStream:
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            await self.close()
        else:
            had_step = self._step is not None
            self.cancel()
            if had_step:
                await self.released()
