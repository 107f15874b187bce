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
output comes back as an array of q_latent's dtype and shape [T, H, L].

A step runs two ways with one meaning: :meth:`AttndClient.stream` (one bidirectional ``Step`` RPC
carrying many steps; the fast path) and the unary calls :meth:`AttndClient.begin_step`,
:meth:`AttndClient.attend_layer` and :meth:`AttndClient.abort_step`. gRPC errors surface as
:class:`AttndError` with the status code and the server's message.

Example::

    with AttndClient("localhost:50051") as client:
        spec = client.info().model
        client.open_sequence("s1")
        with client.stream() as stream:
            stream.begin([("s1", T)])
            for i in range(spec.num_layers):
                out = stream.layer(i, q_latent=..., q_rope=..., kv_latent=..., k_rope=...,
                                   index_q=..., index_k=..., index_w=...)  # indexer: full layers
"""

from __future__ import annotations

import dataclasses
import queue
from typing import Iterator, List, Optional, Sequence, Tuple

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
    "StepInfo",
    "StepStream",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "from_tensor",
    "to_tensor",
]

#: Raises gRPC's default 4 MiB receive limit: a DeepSeek-sized layer message is ~300 KB per token.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30

#: A step's batch: (sequence_id, q_len) pairs; tensors hold sum(q_len) rows in this order.
Batch = Sequence[Tuple[str, int]]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_NAME_OF = {np.dtype(np.float32): "FP32", np.dtype(np.float16): "FP16", _BF16: "BF16"}
_DTYPE_OF = {name: dt for dt, name in _NAME_OF.items()}


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


def to_tensor(array: np.ndarray, *, uint16_as_bf16: bool = False) -> pb.Tensor:
    """A numpy array as a wire Tensor (little-endian, row-major, no padding).

    float32 -> FP32, float16 -> FP16, ml_dtypes.bfloat16 -> BF16, and uint16 -> BF16 (the raw bits)
    when ``uint16_as_bf16``. Any byte order and memory layout is accepted. Raises TypeError for other
    dtypes.
    """
    a = np.asarray(array)
    dt = a.dtype if a.dtype.byteorder in "=|" else a.dtype.newbyteorder("=")
    if dt == np.uint16 and uint16_as_bf16:
        name = "BF16"
    elif dt in _NAME_OF:
        name = _NAME_OF[dt]
    else:
        raise TypeError(
            f"unsupported tensor dtype {a.dtype}: use float32, float16 or ml_dtypes.bfloat16"
            + (" (or uint16 bf16 bits with uint16_as_bf16=True)" if dt == np.uint16 else "")
        )
    size = dt.itemsize
    native = np.ascontiguousarray(a, dtype=dt)
    data = native.view(f"=u{size}").astype(f"<u{size}", copy=False).tobytes()
    return pb.Tensor(datatype=name, shape=list(a.shape), data=data)


def from_tensor(tensor: pb.Tensor, *, uint16_as_bf16: bool = False) -> np.ndarray:
    """A wire Tensor as a (writable) numpy array; BF16 as uint16 bits when ``uint16_as_bf16``."""
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
    cache_datatype: str  # "BF16" or "FP32"
    devices: Tuple[DeviceInfo, ...]
    datatypes: Tuple[str, ...]
    max_message_bytes: int
    step_idle_timeout_ms: int


@dataclasses.dataclass(frozen=True)
class SequenceInfo:
    sequence_id: str
    length: int  # committed tokens
    device: str
    num_pages: int
    in_step: bool


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
    )


def _batch(batch: Batch, write_only: bool) -> pb.BeginStepRequest:
    entries = [pb.BatchEntry(sequence_id=sid, q_len=int(q_len)) for sid, q_len in batch]
    return pb.BeginStepRequest(batch=entries, write_only=write_only)


def _layer_inputs(layer: int, tensors: dict, uint16_as_bf16: bool) -> pb.LayerInputs:
    msg = pb.LayerInputs(layer=int(layer))
    for name, array in tensors.items():
        if array is not None:
            getattr(msg, name).CopyFrom(to_tensor(array, uint16_as_bf16=uint16_as_bf16))
    return msg


def _output(out: pb.LayerOutput, raw_bf16: bool) -> Optional[np.ndarray]:
    if not out.HasField("out") or not out.out.datatype:
        return None  # a write-only step
    return from_tensor(out.out, uint16_as_bf16=raw_bf16)


def _raw_bf16(q_latent: Optional[np.ndarray], uint16_as_bf16: bool) -> bool:
    return uint16_as_bf16 and q_latent is not None and np.asarray(q_latent).dtype == np.uint16


# ---- the client --------------------------------------------------------------------------------


class AttndClient:
    """A connection to one attnd server.

    Args:
      target: "host:port" (any gRPC target).
      max_message_bytes: the channel's receive and send limit (gRPC's default receive limit, 4 MiB,
        is far too small for prefill layers); keep it at most the server's ``max_message_bytes``.
      timeout: a deadline in seconds for every unary call (None: none).
      uint16_as_bf16: accept uint16 arrays as raw bf16 bits (outputs then come back as uint16 too).
      options: extra gRPC channel options.
    """

    def __init__(
        self,
        target: str,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        timeout: Optional[float] = None,
        uint16_as_bf16: bool = False,
        options: Sequence[Tuple[str, object]] = (),
    ) -> None:
        channel_options = [
            ("grpc.max_receive_message_length", int(max_message_bytes)),
            ("grpc.max_send_message_length", int(max_message_bytes)),
            *options,
        ]
        self._channel = grpc.insecure_channel(target, options=channel_options)
        self._stub = pb_grpc.AttentionStub(self._channel)
        self._timeout = timeout
        self._uint16_as_bf16 = uint16_as_bf16

    def _call(self, method, request):
        try:
            return method(request, timeout=self._timeout)
        except grpc.RpcError as e:
            raise AttndError.from_rpc_error(e) from e

    # -- server and sequences --

    def info(self) -> ServerInfo:
        """The model spec, backend, devices and their capacity, version."""
        return _server_info(self._call(self._stub.ServerInfo, pb.ServerInfoRequest()))

    def open_sequence(
        self, sequence_id: str, fork_parent: Optional[str] = None, prefix_len: int = 0
    ) -> SequenceInfo:
        """Creates a sequence: empty, or the first ``prefix_len`` tokens of ``fork_parent``."""
        request = pb.OpenSequenceRequest(
            sequence_id=sequence_id, fork_parent_id=fork_parent or "", fork_prefix_len=prefix_len
        )
        return _plain(SequenceInfo, self._call(self._stub.OpenSequence, request))

    def close_sequence(self, sequence_id: str) -> None:
        """Frees a sequence's pages (FAILED_PRECONDITION while it is in an open step)."""
        self._call(self._stub.CloseSequence, pb.CloseSequenceRequest(sequence_id=sequence_id))

    def describe_sequence(self, sequence_id: str) -> SequenceInfo:
        """A sequence's committed length, device, pages and whether it is in an open step."""
        request = pb.DescribeSequenceRequest(sequence_id=sequence_id)
        return _plain(SequenceInfo, self._call(self._stub.DescribeSequence, request))

    # -- steps: unary --

    def begin_step(self, batch: Batch, *, write_only: bool = False) -> StepInfo:
        """Opens a step over ``batch`` (reserving its pages); then attend_layer 0..N-1 in order.

        ``write_only`` imports keys only (kv_latent, k_rope, index_k; no queries, no output).
        """
        resp = self._call(self._stub.BeginStep, _batch(batch, write_only))
        return StepInfo(step_id=resp.step_id, num_tokens=resp.num_tokens)

    def attend_layer(
        self,
        step_id: int,
        layer: int,
        *,
        q_latent: Optional[np.ndarray] = None,
        q_rope: Optional[np.ndarray] = None,
        kv_latent: np.ndarray,
        k_rope: np.ndarray,
        index_q: Optional[np.ndarray] = None,
        index_k: Optional[np.ndarray] = None,
        index_w: Optional[np.ndarray] = None,
    ) -> Optional[np.ndarray]:
        """Runs the step's next layer; returns out [T, H, L] in q_latent's dtype (None if write-only).

        The last layer commits the step. Any error aborts the step (sequences stay as before it).
        Indexer tensors (index_q [T,Hi,Di], index_k [T,Di], index_w [T,Hi]) go with full layers only.
        """
        tensors = dict(q_latent=q_latent, q_rope=q_rope, kv_latent=kv_latent, k_rope=k_rope,
                       index_q=index_q, index_k=index_k, index_w=index_w)
        request = pb.AttendLayerRequest(
            step_id=step_id, inputs=_layer_inputs(layer, tensors, self._uint16_as_bf16)
        )
        resp = self._call(self._stub.AttendLayer, request)
        return _output(resp.output, _raw_bf16(q_latent, self._uint16_as_bf16))

    def abort_step(self, step_id: int) -> None:
        """Aborts an open step: every sequence in it is left as before the step."""
        self._call(self._stub.AbortStep, pb.AbortStepRequest(step_id=step_id))

    # -- steps: the stream --

    def stream(self, *, timeout: Optional[float] = None) -> "StepStream":
        """Opens a ``Step`` stream (many steps, one at a time). ``timeout`` bounds the whole stream."""
        return StepStream(self._stub, timeout=timeout, uint16_as_bf16=self._uint16_as_bf16)

    # -- lifetime --

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "AttndClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StepStream:
    """One bidirectional ``Step`` RPC carrying many steps, one open at a time.

    ``begin(batch)``, then ``layer(i, ...)`` for i = 0..N-1 (the last one commits), then the next
    ``begin`` — or ``abort()`` in between. Each call sends one message and waits for its reply. An
    error (raised as :class:`AttndError`) ends the stream and aborts its open step; open a new stream
    to go on. ``close()`` aborts an open step and ends the stream cleanly. As a context manager it
    closes on normal exit and cancels (which aborts an open step) on an exception. Not thread-safe.
    """

    def __init__(self, stub: pb_grpc.AttentionStub, *, timeout: Optional[float] = None,
                 uint16_as_bf16: bool = False) -> None:
        self._requests: "queue.Queue[Optional[pb.StepRequest]]" = queue.Queue()
        self._call = stub.Step(self._request_iterator(), timeout=timeout)
        self._uint16_as_bf16 = uint16_as_bf16
        self._step: Optional[StepInfo] = None
        self._next_layer = 0
        self._closed = False

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
            self._requests.put(None)  # ends the request iterator (half-close)

    def _roundtrip(self, request: pb.StepRequest, expect: str) -> pb.StepResponse:
        if self._closed:
            raise RuntimeError("the step stream is closed; open a new one with client.stream()")
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
        kind = response.WhichOneof("kind")
        if kind != expect:
            self.cancel()
            raise AttndError(grpc.StatusCode.INTERNAL,
                             f"Step stream: expected a {expect!r} reply, got {kind!r}")
        return response

    @property
    def step(self) -> Optional[StepInfo]:
        """The open step, or None."""
        return self._step

    @property
    def next_layer(self) -> int:
        """The layer the open step expects next."""
        return self._next_layer

    @property
    def closed(self) -> bool:
        return self._closed

    def begin(self, batch: Batch, *, write_only: bool = False) -> StepInfo:
        """Opens a step over ``batch`` (none may be open on this stream)."""
        response = self._roundtrip(pb.StepRequest(begin=_batch(batch, write_only)), "begun")
        self._step = StepInfo(step_id=response.begun.step_id, num_tokens=response.begun.num_tokens)
        self._next_layer = 0
        return self._step

    def layer(
        self,
        layer: int,
        *,
        q_latent: Optional[np.ndarray] = None,
        q_rope: Optional[np.ndarray] = None,
        kv_latent: np.ndarray,
        k_rope: np.ndarray,
        index_q: Optional[np.ndarray] = None,
        index_k: Optional[np.ndarray] = None,
        index_w: Optional[np.ndarray] = None,
    ) -> Optional[np.ndarray]:
        """Runs the open step's next layer; see :meth:`AttndClient.attend_layer`."""
        tensors = dict(q_latent=q_latent, q_rope=q_rope, kv_latent=kv_latent, k_rope=k_rope,
                       index_q=index_q, index_k=index_k, index_w=index_w)
        request = pb.StepRequest(layer=_layer_inputs(layer, tensors, self._uint16_as_bf16))
        response = self._roundtrip(request, "layer")
        self._next_layer = int(layer) + 1
        if response.layer.committed:
            self._step = None
        return _output(response.layer, _raw_bf16(q_latent, self._uint16_as_bf16))

    def abort(self) -> None:
        """Aborts the open step (a no-op when none is open); the stream stays usable."""
        if self._step is None or self._closed:
            return
        self._roundtrip(pb.StepRequest(abort=pb.AbortStepRequest()), "aborted")
        self._step = None

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
        """Cancels the RPC; the server aborts the open step."""
        self._call.cancel()
        self._finish()

    def __enter__(self) -> "StepStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.cancel()
