"""Tests of the Python client against a real attnd server and an independent float64 reference.

The session server (conftest.py's ``server``: build/service/attnd, env ATTND_BIN overrides, the
tiny model on a free loopback port) and the harness (attnd_testlib) serve them. The reference
models the contract (docs/numerics.md) in float64 with per-sequence key histories kept by the test;
it rounds stored keys the way the server's cache does (bf16 or fp32, from
ServerInfo.cache_datatype), so it needs nothing from the server but its model spec.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Tuple

import grpc
import numpy as np
import pytest

from attnd import AttndClient, AttndError, LayerInputs, from_tensor, to_tensor

from attnd_testlib import BF16, Harness, bits, expect, f64, first_full_layer, rel_l2

REPO = Path(__file__).resolve().parents[3]
PYTHON_DIR = REPO / "client" / "python"

DTYPES = {"bf16": BF16, "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32)}
# Relative L2 error bounds against the float64 reference (docs/numerics.md: bf16 inputs <= 1e-2).
# fp32 inputs
# keep 1e-2 too: the server's cache is bf16, so the design's 1e-5 fp32 target (which assumes an fp32
# cache) does not apply end to end. The reference rounds stored keys like the cache, so the observed
# errors are far smaller; fp16 outputs round at 2^-11, within the same bound.
TOLERANCE = {"bf16": 1e-2, "fp16": 1e-2, "fp32": 1e-2}



# ---- the float64 reference ---------------------------------------------------------------------


# ---- the harness -------------------------------------------------------------------------------


# ---- tests without a server --------------------------------------------------------------------


def test_tensor_conversions():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 7.5
    for dtype, name in [(np.float32, "FP32"), (np.float16, "FP16"), (BF16, "BF16")]:
        x = a.astype(dtype)
        t = to_tensor(x[:, ::-1].transpose(1, 0, 2))  # non-contiguous input
        assert (t.datatype, list(t.shape)) == (name, [3, 2, 4])
        y = from_tensor(t)
        assert y.dtype == np.dtype(dtype) and y.flags.writeable
        np.testing.assert_array_equal(f64(y), f64(x[:, ::-1].transpose(1, 0, 2)))
    # little-endian bytes whatever the array's byte order
    assert to_tensor(np.array([1.0], dtype=">f4")).data == np.array([1.0], "<f4").tobytes()
    assert to_tensor(np.array([1.0], dtype=">f2")).data == np.array([1.0], "<f2").tobytes()
    assert to_tensor(np.array([1.0], dtype=BF16)).data == b"\x80\x3f"
    raw = a.astype(BF16).view(np.uint16)
    t = to_tensor(raw, uint16_as_bf16=True)
    assert t.datatype == "BF16" and t.data == to_tensor(a.astype(BF16)).data
    np.testing.assert_array_equal(from_tensor(t, uint16_as_bf16=True), raw)
    for bad in (raw, a.astype(np.float64), a.astype(np.int32)):
        with pytest.raises(TypeError):
            to_tensor(bad)
    t.data = t.data[:-2]
    with pytest.raises(ValueError):
        from_tensor(t)


def test_missing_descriptor_import_error(tmp_path):
    """A checkout without the compiled descriptor says how to make it."""
    pkg = tmp_path / "attnd"
    (pkg / "v1").mkdir(parents=True)
    src = PYTHON_DIR / "attnd"
    for f in [*src.glob("*.py"), *src.glob("v1/*.py")]:  # every module; no attention.binpb
        (pkg / f.relative_to(src)).write_text(f.read_text())
    r = subprocess.run([sys.executable, "-c", "import attnd"], cwd=tmp_path, capture_output=True,
                       text=True)
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "attention.binpb is missing" in r.stderr, r.stderr
    assert "pip install ./client/python" in r.stderr and "generate_stubs.sh" in r.stderr


# ---- tests against the server ------------------------------------------------------------------


def test_a_layer_call_can_return_what_each_query_attended_and_the_servers_time(client, harness):
    """The details call: the server's seconds on the call; return_attended: each query's key
    positions, the float64 reference's top-k on full layers (pruning: contexts past K), the full
    layer's on shared ones, all visible keys while a query sees at most K."""
    h, K = harness, harness.spec.index_topk
    a, b = h.open("a"), h.open("b")
    h.step(client, [(a, K + 20), (b, 5)])  # a's later queries select K of more keys
    batch = [(a, 3), (b, 2)]
    inputs = h.inputs(5)
    want_out = h.ref.step(batch, inputs)
    step = client.begin_step(batch)
    for i, x in enumerate(inputs):
        r = client.attend_layer_details(step.step_id, LayerInputs(i, return_attended=True, **x))
        assert 0 < r.server_seconds < 30 and r.committed == (i == len(inputs) - 1)
        assert rel_l2(r.out, want_out[i]) < 1e-2 and not np.isnan(f64(r.out)).any()
        assert len(r.attended) == 5
        for t, (got, want) in enumerate(zip(r.attended, h.ref.last_attended[i])):
            np.testing.assert_array_equal(got, want, err_msg=f"layer {i} query {t}")
        assert [len(p) for p in r.attended] == [K] * 3 + [6, 7]  # a: pruned; b: all it sees
    # Only the time: no positions asked, none sent.
    step = client.begin_step([(b, 1)])
    for i, x in enumerate(h.inputs(1)):
        r = client.attend_layer_details(step.step_id, LayerInputs(i, **x))
        assert r.attended is None and r.server_seconds > 0
    h.ref.step([(b, 1)], h.inputs(1))  # keep the reference's lengths in step (outputs unused)
    # Refused where it cannot be served, and the step is aborted as for any bad layer call.
    step = client.begin_step([(a, 1)], write_only=True)
    x = h.inputs(1, write_only=True)[0]
    with pytest.raises(AttndError) as e:
        client.attend_layer_details(step.step_id, LayerInputs(0, return_attended=True, **x))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "write-only" in e.value.details
    assert client.info().max_attended_positions >= 1 << 16


def test_server_info(info):
    s = info.model
    assert info.version and info.backend in ("cpu", "cuda")
    assert s.num_layers >= 2 and s.layers[0] in ("full", "dense")
    assert min(s.kv_lora_rank, s.qk_rope_head_dim, s.num_heads, s.index_n_heads, s.index_head_dim,
               s.index_topk, s.page_size) > 0
    assert 0 < s.sm_scale < 1
    assert {"BF16", "FP16", "FP32"} <= set(info.datatypes)
    assert info.devices and all(d.pages_total > 0 and 0 <= d.pages_free <= d.pages_total
                                for d in info.devices)


@pytest.mark.parametrize("wire", ["bf16", "fp16", "fp32"])
def test_chunked_prefill_then_mixed_decode(harness, client, wire):
    """Two prefill chunks of three sequences, then decode steps where one sequence extends while the
    others decode (order varying); every layer of every step against the reference."""
    h, dtype, tol = harness, DTYPES[wire], TOLERANCE[wire]
    a, b, c = h.open("a"), h.open("b"), h.open("c")
    with client.stream(timeout=300) as stream:
        h.step(stream, [(a, 37), (b, 29), (c, 20)], dtype, tol, what="prefill 1:")
        h.step(stream, [(c, 30), (a, 26), (b, 22)], dtype, tol, what="prefill 2:")
        seqs = [a, b, c]
        for k in range(6):
            extending = seqs[k % 3]
            batch = [(sid, 3 + 2 * k if sid == extending else 1) for sid in seqs]
            batch = batch[k % 3:] + batch[:k % 3]
            h.step(stream, batch, dtype, tol, what=f"decode {k}:")
    h.assert_unchanged([a, b, c])
    assert all(client.describe_sequence(sid).num_pages ==
               -(-h.ref.length(sid) // h.spec.page_size) for sid in (a, b, c))


def test_stream_and_unary_agree(harness, client):
    """Identical inputs on two pairs of identical sequences: the stream and the unary path give
    bit-identical outputs and leave the sequences in the same state."""
    h = harness
    parent = h.open("parent")
    h.step(client, [(parent, 45)], what="parent:")
    # a pair forked at the full length (shared pages), a pair at a partial page (copied page)
    x1, y1 = h.open("x1", parent, 45), h.open("y1", parent, 45)
    x2, y2 = h.open("x2", parent, 33), h.open("y2", parent, 33)
    plan = [[(0, 4), (1, 1)], [(1, 6), (0, 1)], [(0, 1), (1, 1)], [(1, 1), (0, 1)]]
    with client.stream() as stream:
        for entries in plan:
            T = sum(q for _, q in entries)
            inputs = h.inputs(T)
            xb = [((x1, x2)[i], q) for i, q in entries]
            yb = [((y1, y2)[i], q) for i, q in entries]
            via_stream = h.send(stream, xb, inputs)
            via_unary = h.send(client, yb, inputs)
            want_x, want_y = h.ref.step(xb, inputs), h.ref.step(yb, inputs)
            h.check(via_stream, want_x, inputs, f"stream {xb}", 1e-2)
            h.check(via_unary, want_y, inputs, f"unary {yb}", 1e-2)
            for layer, (s_out, u_out) in enumerate(zip(via_stream, via_unary)):
                assert np.array_equal(bits(s_out), bits(u_out)), (f"layer {layer} of {entries} "
                                                                  "differs")
    for x, y in ((x1, y1), (x2, y2)):
        dx, dy = client.describe_sequence(x), client.describe_sequence(y)
        assert (dx.length, dx.num_pages, dx.in_step) == (dy.length, dy.num_pages, False)
        assert dx.length == h.ref.length(x)
    # same state: one more identical step on each pair gives identical outputs
    inputs = h.inputs(3)
    ox = h.send(client, [(x1, 2), (x2, 1)], inputs)
    oy = h.send(client, [(y1, 2), (y2, 1)], inputs)
    for layer, (a, b) in enumerate(zip(ox, oy)):
        assert np.array_equal(bits(a), bits(b)), f"final step, layer {layer} differs"


def test_fork_prefix_then_extend(harness, client):
    """Forks at a partial page and at a page boundary extend (alongside the parent) as the
    reference;
    the parent is unaffected by its children's writes and vice versa."""
    h = harness
    page = h.spec.page_size
    parent = h.open("parent")
    h.step(client, [(parent, 30)], what="parent 1:")
    h.step(client, [(parent, 20)], what="parent 2:")
    mid = h.open("mid", parent, 2 * page + 5)  # partial last page: copied
    aligned = h.open("aligned", parent, 2 * page)  # full pages only: shared
    empty = h.open("empty", parent, 0)
    assert client.describe_sequence(mid).length == 2 * page + 5
    with client.stream() as stream:
        h.step(stream, [(mid, 20), (parent, 3), (aligned, 1)], what="extend:")
        h.step(stream, [(aligned, 9), (mid, 1), (parent, 1), (empty, 4)], what="extend 2:")
        for k in range(3):
            h.step(stream, [(parent, 1), (mid, 1), (aligned, 1), (empty, 1)], what=f"decode {k}:")
    # a fork of a fork, from the middle of the first child's own tokens
    grandchild = h.open("grandchild", mid, 2 * page + 12)
    h.step(client, [(grandchild, 2), (mid, 1)], what="grandchild:")
    h.assert_unchanged([parent, mid, aligned, empty, grandchild])


def test_write_only_step_then_attend(harness, client):
    """Write-only steps (KV import) store keys without output; later steps attend over them."""
    h = harness
    a = h.open("a")
    h.step(client, [(a, 10)])
    for via, q_len in (("unary", 30), ("stream", 7)):
        inputs = h.inputs(q_len, write_only=True)
        if via == "stream":
            with client.stream() as stream:
                outs = h.send(stream, [(a, q_len)], inputs, write_only=True)
        else:
            outs = h.send(client, [(a, q_len)], inputs, write_only=True)
        assert outs == [None] * h.spec.num_layers, via
        h.ref.step([(a, q_len)], inputs)
        h.assert_unchanged([a])
    h.step(client, [(a, 1)])
    h.step(client, [(a, 3)])


def test_raw_uint16_bf16(harness, client, server):
    """uint16 arrays sent as raw bf16 bits (when asked) give the same bits as bfloat16 arrays."""
    h = harness
    parent = h.open("parent")
    h.step(client, [(parent, 28)])
    x, y = h.open("x", parent, 28), h.open("y", parent, 28)
    inputs = h.inputs(2)
    as_bf16 = h.send(client, [(x, 2)], inputs)
    with AttndClient(server, uint16_as_bf16=True) as raw_client:
        raw_inputs = [{k: v.view(np.uint16) for k, v in x_.items()} for x_ in inputs]
        as_raw = h.send(raw_client, [(y, 2)], raw_inputs)
    for a, b in zip(as_bf16, as_raw):
        assert a.dtype == BF16 and b.dtype == np.uint16
        assert np.array_equal(a.view(np.uint16), b)
    with pytest.raises(TypeError):  # not without asking
        client.attend_layer(1, LayerInputs(0, **raw_inputs[0]))


# ---- errors: each leaves the sequences as they were, and the server serving ----------------------


def _two_sequences(h: Harness) -> Tuple[str, str]:
    a, b = h.open("a"), h.open("b")
    h.step(h.client, [(a, 30), (b, 5)])
    return a, b


def test_unknown_sequence_not_found(harness, client):
    h = harness
    a, b = _two_sequences(h)
    ghost = f"{h.tag}-ghost"
    expect(grpc.StatusCode.NOT_FOUND, client.describe_sequence, ghost)
    expect(grpc.StatusCode.NOT_FOUND, client.close_sequence, ghost)
    expect(grpc.StatusCode.NOT_FOUND, client.open_sequence, f"{h.tag}-child", fork_parent=ghost,
           prefix_len=1)
    expect(grpc.StatusCode.NOT_FOUND, client.describe_sequence, f"{h.tag}-child")
    e = expect(grpc.StatusCode.NOT_FOUND, client.begin_step, [(a, 1), (ghost, 1), (b, 2)])
    assert ghost in e.details
    h.assert_unchanged([a, b])
    with client.stream() as stream:
        expect(grpc.StatusCode.NOT_FOUND, stream.begin, [(b, 1), (ghost, 1)])
        assert stream.closed
    h.assert_unchanged([a, b])
    inputs = h.inputs(1)
    expect(grpc.StatusCode.NOT_FOUND, client.attend_layer, 2**63 + 12345,
           LayerInputs(0, **inputs[0]))
    expect(grpc.StatusCode.NOT_FOUND, client.abort_step, 2**63 + 12345)
    h.assert_unchanged([a, b])
    h.assert_serves([a, b])


def test_duplicate_open_already_exists(harness, client):
    h = harness
    a, b = _two_sequences(h)
    expect(grpc.StatusCode.ALREADY_EXISTS, client.open_sequence, a)
    expect(grpc.StatusCode.ALREADY_EXISTS, client.open_sequence, a, fork_parent=b, prefix_len=2)
    h.assert_unchanged([a, b])  # the existing sequence is not reset
    h.assert_serves([a, b])


@pytest.mark.parametrize("path", ["stream", "unary"])
@pytest.mark.parametrize("tensor", ["q_latent", "kv_latent", "index_q", "k_rope"])
def test_wrong_shape_invalid_argument(harness, client, path, tensor):
    """A malformed tensor, at a layer after others succeeded: INVALID_ARGUMENT naming the tensor."""
    h = harness
    a, b = _two_sequences(h)
    spec = h.spec
    bad_layer = {"q_latent": 0, "kv_latent": 1, "index_q": first_full_layer(spec, 1),
                 "k_rope": spec.num_layers - 1}[tensor]
    inputs = h.inputs(3)
    x = dict(inputs[bad_layer])
    t = x[tensor]
    x[tensor] = {"q_latent": lambda: t[:, :, :-1],  # [T, H, L-1]
                 "kv_latent": lambda: np.concatenate([t, t[:1]]),  # [T+1, L]
                 "index_q": lambda: t[:, :-1],  # [T, Hi-1, Di]
                 "k_rope": lambda: t[:, :-2]}[tensor]()  # [T, R-2]
    batch = [(a, 2), (b, 1)]
    if path == "stream":
        with client.stream() as stream:
            stream.begin(batch)
            for i in range(bad_layer):
                stream.layer(LayerInputs(i, **inputs[i]))
            e = expect(grpc.StatusCode.INVALID_ARGUMENT, stream.layer, LayerInputs(bad_layer, **x))
            assert stream.closed
    else:
        step = client.begin_step(batch)
        for i in range(bad_layer):
            client.attend_layer(step.step_id, LayerInputs(i, **inputs[i]))
        e = expect(grpc.StatusCode.INVALID_ARGUMENT, client.attend_layer, step.step_id,
                   LayerInputs(bad_layer, **x))
        # the error aborted the step: a later layer is told so
        nxt = bad_layer + 1 if bad_layer + 1 < spec.num_layers else bad_layer
        expect(grpc.StatusCode.CANCELLED, client.attend_layer, step.step_id,
               LayerInputs(nxt, **inputs[nxt]))
    assert tensor in e.details, e.details
    h.assert_unchanged([a, b])
    h.assert_serves([a, b])


def test_invalid_batches(harness, client):
    h = harness
    a, b = _two_sequences(h)
    expect(grpc.StatusCode.INVALID_ARGUMENT, client.begin_step, [])
    expect(grpc.StatusCode.INVALID_ARGUMENT, client.begin_step, [(a, 1), (b, 0)])
    expect(grpc.StatusCode.INVALID_ARGUMENT, client.begin_step, [(a, 1), (b, 1), (a, 2)])
    # indexer tensors on a shared layer
    shared = [i for i, k in enumerate(h.spec.layers) if k == "shared"]
    if shared:
        inputs = h.inputs(2)
        full = inputs[first_full_layer(h.spec)]
        step = client.begin_step([(a, 1), (b, 1)])
        for i in range(shared[0]):
            client.attend_layer(step.step_id, LayerInputs(i, **inputs[i]))
        e = expect(grpc.StatusCode.INVALID_ARGUMENT, client.attend_layer, step.step_id,
                   LayerInputs(shared[0], **inputs[shared[0]], index_q=full["index_q"]))
        assert "index_q" in e.details
    h.assert_unchanged([a, b])
    h.assert_serves([a, b])


@pytest.mark.parametrize("path", ["stream", "unary"])
@pytest.mark.parametrize("skip", [False, True])
def test_layer_out_of_order_failed_precondition(harness, client, path, skip):
    """A repeated layer or a skipped layer: FAILED_PRECONDITION, the step aborted."""
    h = harness
    a, b = _two_sequences(h)
    inputs = h.inputs(4)
    wrong = 2 if skip else 0  # after layer 0: layer 2 skips layer 1; layer 0 repeats
    batch = [(b, 3), (a, 1)]
    if path == "stream":
        with client.stream() as stream:
            stream.begin(batch)
            stream.layer(LayerInputs(0, **inputs[0]))
            expect(grpc.StatusCode.FAILED_PRECONDITION, stream.layer,
                   LayerInputs(wrong, **inputs[wrong]))
    else:
        step = client.begin_step(batch)
        client.attend_layer(step.step_id, LayerInputs(0, **inputs[0]))
        expect(grpc.StatusCode.FAILED_PRECONDITION, client.attend_layer, step.step_id,
               LayerInputs(wrong, **inputs[wrong]))
        expect(grpc.StatusCode.CANCELLED, client.attend_layer, step.step_id,
               LayerInputs(1, **inputs[1]))
    h.assert_unchanged([a, b])
    h.assert_serves([a, b])


def test_sequence_in_open_step(harness, client):
    """A sequence takes part in one open step at a time and cannot be closed meanwhile."""
    h = harness
    a, b = _two_sequences(h)
    c = h.open("c")
    step = client.begin_step([(a, 2)])
    assert h.states([a, b]) == {a: (30, True), b: (5, False)}
    expect(grpc.StatusCode.FAILED_PRECONDITION, client.begin_step, [(b, 1), (a, 1)])
    expect(grpc.StatusCode.FAILED_PRECONDITION, client.close_sequence, a)
    with client.stream() as stream:
        expect(grpc.StatusCode.FAILED_PRECONDITION, stream.begin, [(a, 1)])
    # b was not left in a step by the failed begin; it can run while a's step is open
    h.step(client, [(b, 2), (c, 3)])
    client.abort_step(step.step_id)
    expect(grpc.StatusCode.NOT_FOUND, client.abort_step, step.step_id)
    h.assert_unchanged([a, b, c])
    h.assert_serves([a, b, c])


@pytest.mark.parametrize("path", ["stream", "unary"])
def test_abort_restores(harness, client, path):
    """Aborting after some layers leaves every sequence as before; the stream stays usable."""
    h = harness
    a, b = _two_sequences(h)
    inputs = h.inputs(6)
    batch = [(a, 5), (b, 1)]
    pages_before = {s: client.describe_sequence(s).num_pages for s in (a, b)}
    if path == "stream":
        with client.stream() as stream:
            stream.begin(batch)
            stream.layer(LayerInputs(0, **inputs[0]))
            stream.layer(LayerInputs(1, **inputs[1]))
            stream.abort()
            assert stream.step is None and not stream.closed
            h.assert_unchanged([a, b])
            h.step(stream, [(a, 2), (b, 3)])  # the same stream goes on
    else:
        step = client.begin_step(batch)
        client.attend_layer(step.step_id, LayerInputs(0, **inputs[0]))
        client.abort_step(step.step_id)
        h.assert_unchanged([a, b])
        assert {s: client.describe_sequence(s).num_pages for s in (a, b)} == pages_before
        h.step(client, [(a, 2), (b, 3)])
    h.assert_unchanged([a, b])
    h.assert_serves([a, b])


def test_stream_cancel_aborts(harness, client):
    """Leaving a stream's context on an exception cancels the RPC; the server aborts the step."""
    h = harness
    a, b = _two_sequences(h)
    inputs = h.inputs(2)
    with pytest.raises(KeyError):
        with client.stream() as stream:
            stream.begin([(a, 1), (b, 1)])
            stream.layer(LayerInputs(0, **inputs[0]))
            raise KeyError("client-side failure")
    assert stream.closed
    deadline = time.monotonic() + 10
    while any(in_step for _, in_step in h.states([a, b]).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    h.assert_unchanged([a, b])
    h.assert_serves([a, b])


def test_fork_beyond_parent_out_of_range(harness, client):
    h = harness
    a, b = _two_sequences(h)
    expect(grpc.StatusCode.OUT_OF_RANGE, client.open_sequence, f"{h.tag}-child", fork_parent=b,
           prefix_len=6)
    expect(grpc.StatusCode.NOT_FOUND, client.describe_sequence, f"{h.tag}-child")
    h.assert_unchanged([a, b])
    h.assert_serves([a, b])


def test_cancel_then_begin_at_once(harness, client):
    """After a stream is cancelled mid-step, the same sequence begins a new step at once (cancel()
    returns only when the server has released it)."""
    h = harness
    a = h.open("cancelled")
    inputs = h.inputs(5)
    for _ in range(15):
        stream = client.stream()
        stream.begin([(a, 5)])
        stream.layer(LayerInputs(0, **inputs[0]))
        stream.cancel()
        step = client.begin_step([(a, 5)])
        client.abort_step(step.step_id)
    assert client.describe_sequence(a).length == 0
    assert not client.describe_sequence(a).in_step
