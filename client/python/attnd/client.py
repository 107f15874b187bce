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
                out = stream.layer(LayerInputs(i, q_latent=..., q_rope=..., kv_latent=...,
                                               k_rope=..., index_q=..., index_k=...,
                                               index_w=...))  # indexer: full layers
        # the same with no tensor bytes on the wire (a client on the server's host)
        with ShmArena(64 << 20) as arena, client.stream() as stream:
            arena.register(client)
            stream.begin([("s1", 1)])
            out = arena.alloc((1, spec.num_heads, spec.kv_lora_rank), ml_dtypes.bfloat16)
            mark = arena.used
            for i in range(spec.num_layers):
                arena.reset(mark)  # reuse the input slots layer after layer
                y = stream.layer(LayerInputs(i, q_latent=arena.put(q_latent), ..., out=out))
                # y views `out`
"""

from __future__ import annotations

import os
from typing import Iterator, List, Optional, Sequence, Tuple

import grpc

from .errors import AttndError
from .handoff import drive, handoff_call, handoff_plan
from .merge import merge_attention, merge_candidates
from .plane_use import AsyncPlaneUse, PlaneUse
from .shm import ShmArena, ShmTensor, TensorArg
from .stream import AsyncStepStream, StepStream
from .sync import run_sync
from .tensors import Fp8Tensor, as_numpy, from_tensor, quantize_fp8, to_tensor, to_torch
from .types import (
    AbsorptionInfo,
    Batch,
    Candidates,
    DeviceInfo,
    LayerResult,
    LoadInfo,
    ModelSpec,
    PrefixCacheInfo,
    PrefixLookup,
    ReplicationInfo,
    SequenceInfo,
    ServerInfo,
    StepInfo,
    TierInfo,
    _plain,
    _server_info,
)
from .v1 import attention_pb2 as pb
from .v1 import attention_pb2_grpc as pb_grpc
from .wire import (
    LayerInputs,
    LayerOutput,
    _batch,
    check_output_call,
    decode_layer,
    encode_layer,
    layer_call,
)

# The client's names, and (re-exported) every name this module held before the package was split
# into modules: ``from attnd.client import X`` keeps working for all of them.
__all__ = [
    "AbsorptionInfo",
    "AsyncAttndClient",
    "AsyncStepStream",
    "AttndClient",
    "AttndError",
    "Batch",
    "Candidates",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DeviceInfo",
    "Fp8Tensor",
    "LayerInputs",
    "LayerOutput",
    "LayerResult",
    "LoadInfo",
    "ModelSpec",
    "PrefixCacheInfo",
    "PrefixLookup",
    "ReplicationInfo",
    "SequenceInfo",
    "ServerInfo",
    "ShmArena",
    "ShmTensor",
    "StepInfo",
    "StepStream",
    "TensorArg",
    "TierInfo",
    "as_numpy",
    "from_tensor",
    "merge_attention",
    "merge_candidates",
    "quantize_fp8",
    "to_tensor",
    "to_torch",
]

#: Raises gRPC's default 4 MiB receive limit: a DeepSeek-sized layer message is ~300 KB per token.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30


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
        # As attnctl: $ATTND_TARGET when no target is given, $ATTND_TOKEN when no token is.
        if target is None:
            target = os.environ.get("ATTND_TARGET") or "localhost:50051"
        self._target = target
        if token is None:
            token = os.environ.get("ATTND_TOKEN") or None
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
        import_length: int = 0, *, prompt_token_ids: Optional[Sequence[int]] = None,
        prompt_block_hashes: Optional[Sequence[bytes]] = None, prefix_salt: bytes = b"",
        import_generation: int = 0,
    ) -> SequenceInfo:
        """Creates a sequence: empty, or the first ``prefix_len`` tokens of ``fork_parent``.
        ``import_length`` > 0 opens a handoff target that serves ordinary steps only once
        write-only steps have brought it to that length, at ``import_generation`` (the
        generation it has where it comes from; 0 = 1).

        The prefix cache (docs/prefix_cache.md): with the prompt's ``prompt_token_ids`` (hashed
        with ``prefix_salt``) or its ``prompt_block_hashes`` (:func:`attnd.hash_blocks`), the
        sequence opens on the longest run of those blocks the server holds for this tenant;
        ``cached_tokens`` of the reply says how many tokens it starts with (prefill the rest;
        with token ids it stops before the last token, whose logits the worker needs)."""
        request = pb.OpenSequenceRequest(
            sequence_id=sequence_id, fork_parent_id=fork_parent or "", fork_prefix_len=prefix_len,
            import_length=import_length, import_generation=int(import_generation),
            prompt_token_ids=[int(t) for t in (prompt_token_ids if prompt_token_ids is not None
                                               else [])],
            prompt_block_hashes=[bytes(h) for h in (prompt_block_hashes or [])],
            prefix_salt=bytes(prefix_salt),
        )
        return self._unary("OpenSequence", request, lambda r: _plain(SequenceInfo, r))

    def lookup_prefix(self, token_ids: Optional[Sequence[int]] = None,
                      block_hashes: Optional[Sequence[bytes]] = None,
                      prefix_salt: bytes = b"") -> PrefixLookup:
        """How many leading blocks of a prompt this server's prefix cache holds for this tenant
        (on one device, any tier), touching nothing: what a router that polls asks."""
        request = pb.LookupPrefixRequest(
            token_ids=[int(t) for t in (token_ids if token_ids is not None else [])],
            block_hashes=[bytes(h) for h in (block_hashes or [])], prefix_salt=bytes(prefix_salt))
        return self._unary("LookupPrefix", request, lambda r: _plain(PrefixLookup, r))

    def close_sequence(self, sequence_id: str, *, standby_generation: int = 0) -> None:
        """Frees a sequence's pages (FAILED_PRECONDITION while it is in an open step).
        ``standby_generation`` nonzero: only if it is a standby copy at that generation
        (FAILED_PRECONDITION otherwise, nothing closed; docs/replication.md)."""
        return self._unary("CloseSequence", pb.CloseSequenceRequest(
            sequence_id=sequence_id, standby_generation=int(standby_generation)))

    def describe_sequence(self, sequence_id: str) -> SequenceInfo:
        """A sequence's committed length, device, pages and whether it is in an open step."""
        request = pb.DescribeSequenceRequest(sequence_id=sequence_id)
        return self._unary("DescribeSequence", request, lambda r: _plain(SequenceInfo, r))

    def promote_sequence(self, sequence_id: str, generation: int, length: int,
                         failed_replica: str = "", release_lease: bool = False) -> SequenceInfo:
        """Failover (docs/replication.md): makes this server's standby copy of ``sequence_id`` at
        ``generation`` the sequence (at generation + 1), cut back to ``length`` tokens when it
        holds more. The reply's ``length`` is where the worker resumes (shorter after an async
        replica's lag: resend the steps after it). ``failed_replica`` (the failed primary's
        name) is not chosen as the next standby. UNAVAILABLE while the primary's lease on the
        copy runs (docs/replication.md#leases), unless ``release_lease``: the primary serves it no
        more (it hands it over, or its address refuses connections). :meth:`Router.failover`
        does it for you."""
        request = pb.PromoteSequenceRequest(sequence_id=sequence_id, generation=int(generation),
                                            length=int(length), failed_replica=failed_replica,
                                            release_lease=bool(release_lease))
        return self._unary("PromoteSequence", request, lambda r: _plain(SequenceInfo, r))

    def list_sequences(self, all_tenants: bool = False) -> List[SequenceInfo]:
        """This tenant's sequences; the admin identity may ask for every tenant's."""
        return self._unary("ListSequences", pb.ListSequencesRequest(all_tenants=all_tenants),
                           lambda r: [_plain(SequenceInfo, s) for s in r.sequences])

    def prefetch_sequences(self, sequence_ids: Sequence[str]) -> None:
        """Restores spilled sequences to their devices in the background, ahead of their steps
        (answers at once; unknown ids are skipped). A step on one waits for that restore rather
        than starting its own. Does nothing on a server without tiers."""
        return self._unary("PrefetchSequences",
                           pb.PrefetchSequencesRequest(sequence_ids=list(sequence_ids)))

    def offload_sequences(self, sequence_ids: Sequence[str]) -> None:
        """Spills sequences down a tier now (a paused conversation) and answers once they are
        there: NotFound, FailedPrecondition (in a step; no tier below the device),
        ResourceExhausted (every tier below is full), DataLoss."""
        return self._unary("OffloadSequences",
                           pb.OffloadSequencesRequest(sequence_ids=list(sequence_ids)))

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
                   query_positions: Optional[Sequence[int]] = None,
                   block_hashes: Optional[Sequence[Sequence[bytes]]] = None,
                   generations: Optional[Sequence[int]] = None,
                   starts: Optional[Sequence[Optional[int]]] = None) -> StepInfo:
        """Opens a step over ``batch`` (reserving its pages); then attend_layer 0..N-1 in order.

        ``write_only`` imports keys only (kv_latent, k_rope, index_k; no queries, no output).
        ``num_shards`` > 1 opens a sharded step as its shard 0: S = num_shards tensor-parallel
        shards (S must divide H; not with ``write_only``) each send their H/S heads per layer —
        here through attend_layer with ``shard=k`` and this step id (unary shards need no join).

        Context parallelism (docs/numerics.md; :class:`attnd.ContextParallelSequence` drives it):
        ``position_offsets`` (per entry, page-aligned) opens a context-parallel step over this
        server's slice of each sequence; with ``query_positions`` (per entry) an attend-only one,
        whose queries follow every key held here and write nothing.

        ``block_hashes`` (per entry, a list): the hashes of the blocks each entry's tokens
        complete, indexed in the prefix cache when the step commits (docs/prefix_cache.md).

        ``generations`` (per entry): each sequence's generation as the worker knows it
        (:attr:`SequenceInfo.generation`); a sequence that failed over since is refused with
        FAILED_PRECONDITION (docs/replication.md).

        ``starts`` (per entry, or None for an entry): the tokens each sequence must hold before
        the step; another length is FAILED_PRECONDITION with nothing changed (a step sent again
        after its reply was lost is refused if it was taken).
        """
        return self._unary("BeginStep",
                           _batch(batch, write_only, num_shards, position_offsets, query_positions,
                                  block_hashes, generations, starts),
                           lambda r: StepInfo(step_id=r.step_id, num_tokens=r.num_tokens))

    def attend_layer(self, step_id: int, inputs: Optional[LayerInputs] = None,
                     **legacy) -> LayerOutput:
        """Runs the step's next layer with ``inputs`` (a :class:`LayerInputs`); returns its output
        [T, H, L] (:data:`LayerOutput`: an array of the query's dtype, a torch tensor with
        ``as_torch``, an :class:`Fp8Tensor` with ``out_datatype="FP8_E4M3"``, None on a write-only
        step; with server-side absorption and ``q_nope``, the values [T, H, V]; a shard's heads
        [T, H/S, *] on a sharded step; a view of the ``out`` slot with shared memory).
        :meth:`attend_layer_details` returns a :class:`LayerResult` (lse, attended positions, the
        server's time) and :meth:`attend_layer_candidates` a context-parallel full layer's
        :class:`Candidates`. ValueError if ``inputs`` asks for return_lse / return_attended.

        The last layer commits the step; any error aborts it (its sequences stay as before).
        Server-side absorption (``info().absorption`` set) takes q_nope instead of q_latent (not on
        sharded steps). ``out_datatype`` is not for ``out`` (shared memory), sharded or write-only
        steps. Sharded steps: every shard calls with its ``shard`` and heads; shard 0 alone sends
        the keys and the indexer tensors; the call returns once every shard's message is in.

        Deprecated (one release): ``attend_layer(step_id, layer, q_latent=..., details=...,
        lse=..., attended=..., candidates=..., ...)`` with keywords, returning what it returned
        before (the output, a LayerResult or Candidates by those flags), with a
        DeprecationWarning."""
        inputs, kind = layer_call("attend_layer", inputs, legacy)
        if kind == "output":
            check_output_call(inputs, "attend_layer")
        return self._attend(step_id, inputs, kind)

    def attend_layer_details(self, step_id: int, inputs: LayerInputs) -> LayerResult:
        """:meth:`attend_layer`, returning a :class:`LayerResult`: the output, the server's
        seconds on the call, whether it committed the step (and, on a replica with standbys,
        where each batch entry's committed rows stand: ``protection``), with
        ``return_attended`` each query's attended key positions (bounded by
        ServerInfo.limits.max_attended_positions; not on sharded steps) and with ``return_lse``
        each query head's log-sum-exp [T, H] float32, by which outputs over disjoint key sets
        merge (:func:`merge_attention`; not on write-only steps)."""
        return self._attend(step_id, inputs, "details")

    def attend_layer_candidates(self, step_id: int, inputs: LayerInputs) -> Candidates:
        """A context-parallel step's full layer, first call (docs/numerics.md): with the keys (none
        on attend-only steps), index_q and index_w, returns this server's :class:`Candidates`; the
        layer then runs again (:meth:`attend_layer` / ``_details``) with
        ``selection=merge_candidates(every server's)`` and the queries only."""
        return self._attend(step_id, inputs, "candidates")

    def _attend(self, step_id: int, inputs: LayerInputs, kind: str):
        request = pb.AttendLayerRequest(
            step_id=step_id,
            inputs=encode_layer(inputs, uint16_as_bf16=self._uint16_as_bf16,
                                candidates=kind == "candidates"))
        uint16_as_bf16 = self._uint16_as_bf16
        return self._unary("AttendLayer", request,
                           lambda r: decode_layer(r.output, inputs, uint16_as_bf16, kind))

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


class AttndClient(PlaneUse, _Api):
    """A connection to one attnd server.

    Args:
      target: "host:port" (any gRPC target); "unix:/path" reaches the server's Unix-socket
        listener, the only way to use shared memory. Default: $ATTND_TARGET, else
        localhost:50051 (as attnctl). ``token`` defaults to $ATTND_TOKEN the same way.
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
        target: Optional[str] = None,
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
        data_plane: str = "auto",
        data_plane_bytes: int = 64 << 20,
    ) -> None:
        if data_plane not in ("auto", "off"):
            raise ValueError(f"data_plane: {data_plane!r} is not 'auto' or 'off'")
        self._init_channel(grpc, target, max_message_bytes, options, root_certificates,
                           private_key, certificate_chain, server_name, token, act_as_tenant,
                           timeout, uint16_as_bf16)
        self._init_plane(data_plane, data_plane_bytes)

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

    def handoff(self, sequence_id: str, to: AttndClient, *, chunk_tokens: int = 0,
                close_source: bool = False) -> SequenceInfo:
        """Copies a sequence to the server behind ``to`` (same id): it is opened there as a
        handoff target (refusing ordinary steps until complete), filled with write-only steps
        from :meth:`export_sequence`, and its length checked; on failure the partial copy is
        closed. ``close_source`` closes it here once the copy is confirmed."""
        chunks = None

        async def perform(op):
            nonlocal chunks
            if op[0] != "next_chunk":
                return handoff_call(op, self, to, sequence_id)
            if chunks is None:
                chunks = self.export_sequence(sequence_id, chunk_tokens)
            return next(chunks, None)
        plan = handoff_plan(sequence_id, self.describe_sequence(sequence_id), close_source)
        try:
            return run_sync(drive(plan, perform))
        finally:
            if chunks is not None:
                chunks.close()  # cancels the export where the copy failed

    # -- steps: the stream --

    def stream(self, *, timeout: Optional[float] = None) -> StepStream:
        """Opens a ``Step`` stream (many steps, one at a time). ``timeout`` bounds the whole
        stream."""
        return StepStream(self._stub, timeout=timeout, uint16_as_bf16=self._uint16_as_bf16,
                          metadata=self._metadata, plane=self._plane)

    # -- lifetime --

    def close(self) -> None:
        self._close_plane()
        self._channel.close()

    def __enter__(self) -> AttndClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncAttndClient(AsyncPlaneUse, _Api):
    """The asyncio client (grpc.aio): the same methods and arguments as :class:`AttndClient`,
    each returning an awaitable — ``info = await client.info()`` — plus ``async with`` and
    :meth:`stream` (an :class:`AsyncStepStream`). Any number of calls may be in flight at once
    from one event loop (a step's layers still go in order). Shared-memory tensors work as with
    the sync client (the arena itself is registered through a sync client or
    ``await client.register_shared_memory(...)``), and so does the UCX data plane
    (``data_plane``, ``data_plane_bytes``; ``await client.connect_data_plane()``)."""

    def __init__(self, target: Optional[str] = None, **kwargs) -> None:
        defaults = dict(max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES, options=(),
                        root_certificates=None, private_key=None, certificate_chain=None,
                        server_name=None, token=None, act_as_tenant=None, timeout=None,
                        uint16_as_bf16=False, data_plane="auto", data_plane_bytes=64 << 20)
        unknown = set(kwargs) - set(defaults)
        if unknown:
            raise TypeError(f"unexpected arguments {sorted(unknown)}")
        a = {**defaults, **kwargs}
        if a["data_plane"] not in ("auto", "off"):
            raise ValueError(f"data_plane: {a['data_plane']!r} is not 'auto' or 'off'")
        self._init_plane(a["data_plane"], a["data_plane_bytes"])
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

    async def handoff(self, sequence_id: str, to: AsyncAttndClient, *, chunk_tokens: int = 0,
                      close_source: bool = False) -> SequenceInfo:
        """See :meth:`AttndClient.handoff`."""
        chunks = None

        async def perform(op):
            nonlocal chunks
            if op[0] != "next_chunk":
                return await handoff_call(op, self, to, sequence_id)
            if chunks is None:
                chunks = self.export_sequence(sequence_id, chunk_tokens)
            try:
                return await chunks.__anext__()
            except StopAsyncIteration:
                return None
        plan = handoff_plan(sequence_id, await self.describe_sequence(sequence_id), close_source)
        try:
            return await drive(plan, perform)
        finally:
            if chunks is not None:
                await chunks.aclose()

    def stream(self, *, timeout: Optional[float] = None) -> AsyncStepStream:
        """Opens a ``Step`` stream on this client's channel (see :class:`AsyncStepStream`)."""
        return AsyncStepStream(self._stub, timeout=timeout, uint16_as_bf16=self._uint16_as_bf16,
                               metadata=self._metadata, plane=self._plane)

    async def close(self) -> None:
        await self._aclose_plane()
        await self._channel.close()

    async def __aenter__(self) -> AsyncAttndClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
