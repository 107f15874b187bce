"""Sharded steps and system shared memory through the Python client, against a real attnd.

Sharded steps: S tensor-parallel shards (threads, each with its own stream, or unary calls) run one
step; per token their outputs, concatenated over the head axis, must be bit-identical to an
unsharded
step with the same inputs on a twin sequence (twins: forks of one parent at its full length, so both
hold the same keys). Shared memory: the same step with every input and the output in a registered
region must be bit-identical to the bytes path. Errors leave every sequence as it was.

The session server and the harness (sequences kept in step with a float64 reference) are conftest's
fixtures; this module's ``client`` talks to the server over its Unix-socket listener.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import grpc
import numpy as np
import pytest

from attnd import AttndClient, AttndError, LayerInputs, ShmArena, ShmTensor, StepStream
from attnd.v1 import attention_pb2 as pb
from attnd.v1 import attention_pb2_grpc as pb_grpc

from attnd_testlib import (
    BF16,
    SHARD_TIMEOUT_S,
    Batch,
    Harness,
    LayerTensors,
    bits,
    expect,
    f64,
    first_full_layer,
    local_target,
    run_sharded,
    shard_inputs,
)

PYTHON_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def client(server):  # (this module's client: over the Unix-socket listener)
    """Shared memory is served only over the server's Unix-socket listener."""
    with AttndClient(local_target(server), timeout=60.0) as c:
        yield c

ARENA_BYTES = 4 << 20


# ---- helpers -----------------------------------------------------------------------------------


def check_finite(a: np.ndarray, what: str) -> None:
    assert np.isfinite(f64(a)).all(), f"{what}: NaN/inf in the output"


def twins(h: Harness, n: int, prefix: int) -> Tuple[List[str], List[str]]:
    """n pairs of twins: forks of one parent at its full length (a prefill of ``prefix`` tokens)."""
    parent = h.open("parent")
    h.step(h.client, [(parent, prefix)], what="parent:")
    xs = [h.open(f"x{i}", parent, prefix) for i in range(n)]
    ys = [h.open(f"y{i}", parent, prefix) for i in range(n)]
    return xs, ys


#: A prefill chunk of two sequences, then two decode steps (entries: (twin index, q_len)).
PLAN = [[(0, 13), (1, 6)], [(1, 1), (0, 1)], [(0, 1), (1, 1)]]


def assert_twins_agree(h: Harness, xs: Sequence[str], ys: Sequence[str]) -> None:
    for x, y in zip(xs, ys):
        dx, dy = h.client.describe_sequence(x), h.client.describe_sequence(y)
        assert (dx.length, dx.num_pages, dx.in_step) == (dy.length, dy.num_pages, False), (dx, dy)
    h.assert_unchanged([*xs, *ys])


# ---- sharded steps -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["stream", "unary"])
@pytest.mark.parametrize("shards", ["2", "H"])
def test_sharded_matches_unsharded(harness, client, server, path, shards):
    """S shards in S threads (shard 0 begins with num_shards=S, the others join) over a prefill
    chunk
    and two decode steps: their outputs, concatenated per token over the heads, are bit-identical to
    an unsharded step with the same inputs on twin sequences."""
    h = harness
    H, L = h.spec.num_heads, h.spec.kv_lora_rank
    S = 2 if shards == "2" else H
    assert H % S == 0
    xs, ys = twins(h, 2, 40)
    clients = [AttndClient(server, timeout=SHARD_TIMEOUT_S) for _ in range(S)]  # a worker per shard
    streams = [c.stream(timeout=300) for c in clients] if path == "stream" else []
    try:
        for n, entries in enumerate(PLAN):
            T = sum(q for _, q in entries)
            xb, yb = [(xs[i], q) for i, q in entries], [(ys[i], q) for i, q in entries]
            inputs = h.inputs(T)
            sharded = run_sharded(streams or clients, xb, inputs, S)
            whole = h.send(client, yb, inputs)
            want_x, want_y = h.ref.step(xb, inputs), h.ref.step(yb, inputs)
            h.check(whole, want_y, inputs, f"unsharded {yb}", 1e-2)
            for layer, (parts, ref) in enumerate(zip(sharded, whole)):
                what = f"step {n} layer {layer}"
                for k, part in enumerate(parts):
                    assert part.dtype == BF16 and part.shape == (T, H // S, L), (what, k,
                                                                                 part.shape)
                    check_finite(part, f"{what} shard {k}")
                got = np.concatenate(parts, axis=1)
                assert np.array_equal(bits(got), bits(ref)), f"{what}: shards differ from unsharded"
            h.check([np.concatenate(p, axis=1) for p in sharded], want_x, inputs, f"sharded {xb}",
                    1e-2)
        for stream in streams:
            stream.close()
    finally:
        for stream in streams:
            if not stream.closed:
                stream.cancel()
        for c in clients:
            c.close()
    assert_twins_agree(h, xs, ys)


def test_bad_shard_count_invalid_argument(harness, client):
    """num_shards not dividing H (or negative, or with write_only): INVALID_ARGUMENT, nothing
    open."""
    h = harness
    a = h.open("a")
    h.step(client, [(a, 20)])
    H = h.spec.num_heads
    bad = [n for n in range(2, H + 2) if H % n != 0][0]  # 3 for H = 4
    for n, write_only in ((bad, False), (H + 1, False), (-1, False), (2, True)):
        e = expect(grpc.StatusCode.INVALID_ARGUMENT, client.begin_step, [(a, 1)], num_shards=n,
                   write_only=write_only)
        assert "num_shards" in e.details, e.details
        h.assert_unchanged([a])
    with client.stream() as stream:
        expect(grpc.StatusCode.INVALID_ARGUMENT, stream.begin, [(a, 2)], num_shards=bad)
        assert stream.closed
    h.assert_unchanged([a])
    h.assert_serves([a])


def test_join_errors_and_abort(harness, client):
    """Joining an unknown step: NOT_FOUND; a shard outside [1, S): INVALID_ARGUMENT; a layer message
    from shard 0 without keys is refused by the client; aborting reaches the joined stream."""
    h = harness
    a, b = h.open("a"), h.open("b")
    h.step(client, [(a, 20), (b, 3)])
    inputs = h.inputs(3)
    step = client.begin_step([(a, 2), (b, 1)], num_shards=2)
    for step_id, shard, code in ((step.step_id + 10**6, 1, grpc.StatusCode.NOT_FOUND),
                                 (step.step_id, 2, grpc.StatusCode.INVALID_ARGUMENT),
                                 (step.step_id, 0, grpc.StatusCode.INVALID_ARGUMENT)):
        with client.stream() as stream:
            expect(code, stream.join, step_id, shard)
            assert stream.closed
    unsharded = client.begin_step([(h.open("c"), 1)])  # joining an unsharded step
    with client.stream() as stream:
        expect(grpc.StatusCode.NOT_FOUND, stream.join, unsharded.step_id, 1)
    client.abort_step(unsharded.step_id)
    with pytest.raises(TypeError):  # shard 0 must send the keys
        client.attend_layer(step.step_id, LayerInputs(0, **shard_inputs(inputs[0], 2, 1)))
    assert h.states([a, b]) == {a: (20, True), b: (3, True)}
    with client.stream() as stream:
        assert stream.join(step.step_id, 1).num_tokens == 3
        client.abort_step(step.step_id)  # shard 0 aborts: the joined stream's next layer fails
        with pytest.raises(AttndError) as e:
            stream.layer(LayerInputs(0, **shard_inputs(inputs[0], 2, 1)))
        assert e.value.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED), e.value
    h.assert_unchanged([a, b])
    h.assert_serves([a, b])


@pytest.mark.parametrize("path", ["stream", "unary"])
def test_shard_error_aborts_every_shard(harness, client, server, path):
    """A malformed message from shard 1 at layer 1: both shards' calls fail, the step is aborted for
    both, the sequences are as before."""
    h = harness
    a, b = h.open("a"), h.open("b")
    h.step(client, [(a, 25), (b, 4)])
    inputs = h.inputs(3)

    def bad(k, layer, msg):
        if k == 1 and layer == 1:
            msg = dict(msg, q_latent=msg["q_latent"][:, :, :-1])  # [T, H/S, L-1]
        return msg

    clients = [AttndClient(server, timeout=SHARD_TIMEOUT_S) for _ in range(2)]
    streams = [c.stream(timeout=60) for c in clients] if path == "stream" else []
    try:
        with pytest.raises(AttndError) as e:
            run_sharded(streams or clients, [(a, 2), (b, 1)], inputs, 2, layer_kwargs=bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "q_latent (shard 1)" in e.value.details, e.value.details
        assert all(s.closed for s in streams)
    finally:
        for s in streams:
            s.cancel()
        for c in clients:
            c.close()
    h.assert_unchanged([a, b])
    h.assert_serves([a, b])


# ---- shared memory -----------------------------------------------------------------------------


@pytest.fixture
def arena(client):
    """A fresh shared-memory arena registered with the server; unregistered, unmapped and unlinked
    at teardown (explicitly: the resource tracker has nothing to clean up or warn about)."""
    a = ShmArena(ARENA_BYTES)
    a.register(client)
    path = Path("/dev/shm") / a.name
    assert path.exists() or sys.platform != "linux", path
    yield a
    a.close()
    assert not path.exists()
    expect(grpc.StatusCode.NOT_FOUND, client.unregister_shared_memory, a.region)


def to_shm(arena: ShmArena, x: LayerTensors) -> Dict[str, ShmTensor]:
    return {name: arena.put(v) for name, v in x.items()}


def run_shm_step(via, arena: ShmArena, batch: Batch, inputs: List[LayerTensors],
                 S: int = 1, k: int = 0, step_id: Optional[int] = None) -> List[np.ndarray]:
    """A step (or shard k of a sharded step) with every tensor and the output in ``arena``; per
    layer
    the input slots are reused and the output is copied out of the (reused) output slot."""
    H, L = inputs[0]["q_latent"].shape[1], inputs[0]["kv_latent"].shape[1]
    T = sum(q for _, q in batch)
    out = arena.alloc((T, H // S, L), inputs[0]["q_latent"].dtype)
    mark = arena.used
    outs = []
    for i, x in enumerate(inputs):
        arena.reset(mark)
        msg = to_shm(arena, shard_inputs(x, S, k) if S > 1 else x)
        if isinstance(via, StepStream):
            y = via.layer(LayerInputs(i, out=out, **msg))
        else:
            y = via.attend_layer(step_id, LayerInputs(i, shard=k, out=out, **msg))
        assert y.shape == (T, H // S, L) and y.dtype == out.dtype, (y.shape, y.dtype)
        assert np.array_equal(bits(y), bits(arena.read(out))), "the result does not view the slot"
        outs.append(y.copy())  # the slot is rewritten by the next layer
        del y
    return outs


@pytest.mark.parametrize("path", ["stream", "unary"])
def test_shm_matches_bytes(harness, client, arena, path):
    """The same steps with every input and the output in a registered region: bit-identical to the
    bytes path, on twin sequences, over a prefill chunk and two decode steps."""
    h = harness
    xs, ys = twins(h, 2, 37)
    with client.stream() as stream:
        for n, entries in enumerate(PLAN):
            T = sum(q for _, q in entries)
            xb, yb = [(xs[i], q) for i, q in entries], [(ys[i], q) for i, q in entries]
            inputs = h.inputs(T)
            arena.reset()
            if path == "stream":
                assert stream.begin(xb).num_tokens == T
                via_shm = run_shm_step(stream, arena, xb, inputs)
                assert stream.step is None
            else:
                step = client.begin_step(xb)
                via_shm = run_shm_step(client, arena, xb, inputs, step_id=step.step_id)
            via_bytes = h.send(client, yb, inputs)
            h.check(via_shm, h.ref.step(xb, inputs), inputs, f"shm {xb}", 1e-2)
            h.check(via_bytes, h.ref.step(yb, inputs), inputs, f"bytes {yb}", 1e-2)
            for layer, (s, b) in enumerate(zip(via_shm, via_bytes)):
                assert np.array_equal(bits(s), bits(b)), f"step {n} layer {layer}: shm differs"
    assert_twins_agree(h, xs, ys)


def test_shm_sharded(harness, client, server, arena):
    """Two shards over two streams, each with its inputs and output in the region: bit-identical to
    the unsharded bytes path on a twin."""
    h = harness
    H = h.spec.num_heads
    xs, ys = twins(h, 2, 21)
    shard_arena = ShmArena(ARENA_BYTES)  # shard 1's own slots
    clients = [AttndClient(local_target(server), timeout=SHARD_TIMEOUT_S) for _ in range(2)]
    try:
        shard_arena.register(clients[1])
        arenas = [arena, shard_arena]
        for entries in PLAN[:2]:
            T = sum(q for _, q in entries)
            xb, yb = [(xs[i], q) for i, q in entries], [(ys[i], q) for i, q in entries]
            inputs = h.inputs(T)
            for a in arenas:
                a.reset()
            begun: queue.Queue[Optional[int]] = queue.Queue()

            def shard(k: int, begun=begun, xb=xb, inputs=inputs) -> List[np.ndarray]:
                with clients[k].stream(timeout=60) as stream:
                    if k == 0:
                        try:
                            begun.put(stream.begin(xb, num_shards=2).step_id)
                        except BaseException:
                            begun.put(None)
                            raise
                    else:
                        step_id = begun.get(timeout=SHARD_TIMEOUT_S)
                        assert step_id is not None
                        stream.join(step_id, 1)
                    return run_shm_step(stream, arenas[k], xb, inputs, S=2, k=k)

            with ThreadPoolExecutor(max_workers=2) as pool:
                futures = [pool.submit(shard, k) for k in range(2)]
                parts = [f.result(timeout=SHARD_TIMEOUT_S) for f in futures]
            whole = h.send(client, yb, inputs)
            h.ref.step(xb, inputs)
            h.check(whole, h.ref.step(yb, inputs), inputs, f"bytes {yb}", 1e-2)
            for layer, ref in enumerate(whole):
                got = np.concatenate([parts[0][layer], parts[1][layer]], axis=1)
                assert got.shape == (T, H, h.spec.kv_lora_rank)
                assert np.array_equal(bits(got), bits(ref)), f"layer {layer} differs"
    finally:
        shard_arena.close()
        for c in clients:
            c.close()
    assert_twins_agree(h, xs, ys)


def test_shm_reply_carries_the_reference_not_bytes(harness, client, server, arena):
    """On the wire: with out_shm the reply's `out` names the slot and carries no bytes; a
    write-only step with shared-memory keys returns no output."""
    h = harness
    a = h.open("a")
    inputs = h.inputs(5)
    out = arena.alloc((5, h.spec.num_heads, h.spec.kv_lora_rank), BF16)
    step = client.begin_step([(a, 5)])
    with grpc.insecure_channel(local_target(server)) as channel:
        stub = pb_grpc.AttentionStub(channel)
        for i, x in enumerate(inputs):
            msg = pb.LayerInputs(layer=i, out_shm=out.ref())
            for name, v in x.items():
                getattr(msg, name).CopyFrom(arena.put(v).to_tensor())
            resp = stub.AttendLayer(pb.AttendLayerRequest(step_id=step.step_id, inputs=msg),
                                    timeout=60)
            t = resp.output.out
            assert (t.datatype, list(t.shape), t.data) == ("BF16", list(out.shape), b""), t
            assert t.shm == out.ref(), t.shm
            assert resp.output.committed == (i == len(inputs) - 1)
    h.ref.step([(a, 5)], inputs)
    wo = h.inputs(3, write_only=True)
    step = client.begin_step([(a, 3)], write_only=True)
    for i, x in enumerate(wo):
        assert client.attend_layer(step.step_id, LayerInputs(i, **to_shm(arena, x))) is None
    h.ref.step([(a, 3)], wo)
    h.assert_unchanged([a])
    h.assert_serves([a])


def _fail_at(h: Harness, client: AttndClient, arena: ShmArena, path: str, bad_layer: int,
             code: grpc.StatusCode, change) -> AttndError:
    """Runs layers 0..bad_layer-1 of a step over two sequences with shared-memory inputs, then layer
    bad_layer with ``change(kwargs)`` applied; expects ``code``."""
    a, b = h.opened[:2]
    batch = [(a, 2), (b, 1)]
    inputs = h.inputs(3)
    T, H, L = 3, h.spec.num_heads, h.spec.kv_lora_rank
    out = arena.alloc((T, H, L), BF16)
    kwargs = [dict(to_shm(arena, x), out=out) for x in inputs]
    if path == "stream":
        with client.stream() as stream:
            stream.begin(batch)
            for i in range(bad_layer):
                stream.layer(LayerInputs(i, **kwargs[i]))
            e = expect(code, stream.layer, LayerInputs(bad_layer, **change(kwargs[bad_layer])))
            assert stream.closed
    else:
        step = client.begin_step(batch)
        for i in range(bad_layer):
            client.attend_layer(step.step_id, LayerInputs(i, **kwargs[i]))
        e = expect(code, client.attend_layer, step.step_id,
                   LayerInputs(bad_layer, **change(kwargs[bad_layer])))
        expect(grpc.StatusCode.NOT_FOUND, client.abort_step, step.step_id)  # the error aborted it
    return e


@pytest.mark.parametrize("path", ["stream", "unary"])
@pytest.mark.parametrize("tensor", ["q_latent", "kv_latent", "index_w", "out"])
def test_shm_unknown_region_not_found(harness, client, arena, path, tensor):
    h = harness
    a, b = h.open("a"), h.open("b")
    h.step(client, [(a, 30), (b, 5)])
    bad_layer = 0 if tensor == "index_w" else 1

    def change(kw):
        return dict(kw, **{tensor: dataclasses.replace(kw[tensor], region="no-such-region")})

    e = _fail_at(h, client, arena, path, bad_layer, grpc.StatusCode.NOT_FOUND, change)
    assert "no-such-region" in e.details, e.details
    assert ("out_shm" if tensor == "out" else tensor) in e.details, e.details
    h.assert_unchanged([a, b])
    h.assert_serves([a, b])


@pytest.mark.parametrize("path", ["stream", "unary"])
@pytest.mark.parametrize("tensor", ["q_rope", "k_rope", "index_q", "out"])
@pytest.mark.parametrize("where", ["end", "straddle", "negative", "huge"])
def test_shm_offset_out_of_range_invalid_argument(harness, client, arena, path, tensor, where):
    """A reference beyond the region (at its end, straddling it, negative, or where offset + size
    overflows int64): INVALID_ARGUMENT naming the tensor, at a layer after others succeeded; the
    sequences are as before."""
    h = harness
    a, b = h.open("a"), h.open("b")
    h.step(client, [(a, 30), (b, 5)])
    spec = h.spec
    bad_layer = {"q_rope": 1, "k_rope": spec.num_layers - 1, "index_q": first_full_layer(spec, 1),
                 "out": 2}[tensor]

    def change(kw):
        t = kw[tensor]
        offset = {"end": arena.size, "straddle": arena.size - t.nbytes // 2, "negative": -64,
                  "huge": 2**63 - 64}[where]
        return dict(kw, **{tensor: dataclasses.replace(t, offset=offset)})

    e = _fail_at(h, client, arena, path, bad_layer, grpc.StatusCode.INVALID_ARGUMENT, change)
    assert ("out_shm" if tensor == "out" else tensor) in e.details, e.details
    h.assert_unchanged([a, b])
    h.assert_serves([a, b])


def test_shm_out_wrong_size_invalid_argument(harness, client, arena):
    h = harness
    a, b = h.open("a"), h.open("b")
    h.step(client, [(a, 30), (b, 5)])
    H, L = h.spec.num_heads, h.spec.kv_lora_rank
    small = arena.alloc((3, H, L - 1), BF16)
    e = _fail_at(h, client, arena, "unary", 1, grpc.StatusCode.INVALID_ARGUMENT,
                 lambda kw: dict(kw, out=small))
    assert "out_shm" in e.details and "byte_size" in e.details, e.details
    h.assert_unchanged([a, b])
    h.assert_serves([a, b])


def test_register_errors(harness, client, arena):
    """Unknown object: NOT_FOUND; a name in use: ALREADY_EXISTS; a range beyond the object or empty:
    INVALID_ARGUMENT; unregistering an unknown region: NOT_FOUND. A sub-range region works."""
    h = harness
    tag = h.tag
    e = expect(grpc.StatusCode.NOT_FOUND, client.register_shared_memory, f"{tag}-ghost",
               f"/attnd-no-such-object-{os.getpid()}", 4096)
    assert "no-such-object" in e.details
    expect(grpc.StatusCode.ALREADY_EXISTS, client.register_shared_memory, arena.region, arena.key,
           4096)
    expect(grpc.StatusCode.INVALID_ARGUMENT, client.register_shared_memory, f"{tag}-big", arena.key,
           arena.size + 1)
    expect(grpc.StatusCode.INVALID_ARGUMENT, client.register_shared_memory, f"{tag}-off", arena.key,
           4096, offset=arena.size - 100)
    expect(grpc.StatusCode.INVALID_ARGUMENT, client.register_shared_memory, f"{tag}-empty",
           arena.key, 0)
    expect(grpc.StatusCode.NOT_FOUND, client.unregister_shared_memory, f"{tag}-ghost")
    # a region over a sub-range of the object (at a non-page-aligned offset): region offsets are
    # relative to its start
    sub, base = f"{tag}-sub", 3 * 4096 + 192
    client.register_shared_memory(sub, arena.key, 64 * 1024, offset=base)
    try:
        a = h.open("a")
        inputs = h.inputs(2)
        arena.reset()
        arena.alloc((base,), np.uint8)  # keep the arena's own slots clear of the sub-region
        step = client.begin_step([(a, 2)])
        for i, x in enumerate(inputs):
            msg = {}
            for name, v in x.items():
                slot = arena.put(v)
                msg[name] = ShmTensor(sub, slot.offset - base, slot.dtype, slot.shape)
            y = client.attend_layer(step.step_id, LayerInputs(i, **msg))
            check_finite(y, f"sub-region layer {i}")
        h.ref.step([(a, 2)], inputs)
        h.assert_unchanged([a])
    finally:
        client.unregister_shared_memory(sub)
    expect(grpc.StatusCode.NOT_FOUND, client.unregister_shared_memory, sub)


# ---- the arena, without a server ---------------------------------------------------------------


def test_arena_slots():
    with ShmArena(1 << 16, alignment=64) as arena:
        assert arena.key == "/" + arena.name and arena.region == arena.name
        x = np.random.default_rng(1).standard_normal((3, 5)).astype(BF16)
        s1 = arena.put(x)
        s2 = arena.put(x[:, ::2].astype(np.float32))  # any layout
        s3 = arena.put(np.arange(7, dtype=">f2"))  # any byte order: stored little-endian
        assert (s1.offset, s2.offset, s3.offset) == (0, 64, 128)
        assert s1.ref() == pb.SharedMemoryRef(region=arena.region, offset=0, byte_size=30)
        t = s3.to_tensor()
        assert (t.datatype, list(t.shape), t.data, t.shm.byte_size) == ("FP16", [7], b"", 14)
        assert np.array_equal(bits(arena.read(s1)), bits(x))
        assert np.array_equal(arena.read(s2), x[:, ::2].astype(np.float32))
        assert bytes(arena.buf[128:132]) == np.arange(2, dtype="<f2").tobytes()
        view = arena.read(s1)
        arena.write(s1, -x)
        assert np.array_equal(f64(view), -f64(x))  # a view
        copy = arena.read(s1, copy=True)
        arena.write(s1, x)
        assert np.array_equal(f64(copy), -f64(x))
        mark = arena.used
        arena.put(x)
        arena.reset(mark)
        assert arena.used == mark and arena.alloc((1,), np.float32).offset == 192
        with pytest.raises(MemoryError):
            arena.alloc((1 << 16,), np.uint8)
        with pytest.raises(TypeError):
            arena.put(np.zeros(3, np.float64))
        with pytest.raises(ValueError):
            arena.write(s1, np.zeros((3, 4), BF16))
        with pytest.raises(TypeError):  # uint16 slots are raw bf16 bits: only if the client asks
            arena.put(np.zeros(2, np.uint16)).to_tensor()
        assert arena.put(np.zeros(2, np.uint16)).to_tensor(uint16_as_bf16=True).datatype == "BF16"
        with pytest.raises(BufferError):  # a view of the mapping is alive: close refuses to unmap
            arena.close()
        assert arena.closed and not (Path("/dev/shm") / arena.name).exists()  # but unlinked
        assert np.array_equal(bits(view), bits(x))  # the mapping outlives close() while viewed
        del view, copy
        arena.close()  # now unmaps
        assert arena._unmapped is None
    assert not (Path("/dev/shm") / arena.name).exists()


_CHILD = """
import sys
sys.path.insert(0, {python_dir!r})
import numpy as np
from attnd import ShmArena
mode, name = sys.argv[1], sys.argv[2]
if mode == "attach":
    with ShmArena.attach(name) as a:
        assert a.size == 4096, a.size
        assert a.read(a.slot(0, (4,), np.float32)).tolist() == [1, 2, 3, 4]
        a.write(a.slot(16, (2,), np.float32), np.array([5, 6], np.float32))
else:
    with ShmArena(4096, name) as a:
        a.put(np.ones(8, np.float32))
"""


def test_arena_resource_tracker_neither_unlinks_nor_warns(tmp_path):
    """Another process attaching to an arena and exiting leaves the object alone; one that creates
    and closes its own arena removes it. Neither makes the resource tracker warn."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD.format(python_dir=str(PYTHON_DIR))))
    with ShmArena(4096) as arena:
        arena.put(np.array([1, 2, 3, 4], np.float32))
        r = subprocess.run([sys.executable, "-W", "always", str(script), "attach", arena.name],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert (Path("/dev/shm") / arena.name).exists(), "the attaching process unlinked the object"
        assert arena.read(arena.slot(16, (2,), np.float32)).tolist() == [5, 6]
    name = f"attnd-test-{os.getpid()}-own"
    r = subprocess.run([sys.executable, "-W", "always", str(script), "create", name],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert not (Path("/dev/shm") / name).exists()
