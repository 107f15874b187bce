"""Context parallelism (docs/numerics.md) through the Python client: a sequence split over 2 and
over 3 real attnd servers, driven by ContextParallelSequence, gives for every layer kind (full,
shared, dense) and every selection mode (token, page_union, page_budget; sparse and dense prefill)
the same outputs (fp32, <= 1e-5 relative L2), log-sum-exps and attended keys as one server holding
it all, through chunked prefill and decode; merge_candidates against a float64 sort."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest

from attnd import (
    AttndClient,
    Candidates,
    ContextParallelSequence,
    LayerInputs,
    merge_candidates,
)

from attnd_process import start
from attnd_testlib import random_layer

MODES = ["token", "page_union", "page_budget:2"]


def _spec(tmp_path, selection, prefill):
    p = tmp_path / f"cp-{selection.replace(':', '-')}-{prefill}.json"
    p.write_text(json.dumps({"base": "tiny", "name": "cp", "layers": "FSFD", "soft_cap": 20,
                             "selection": selection, "page_union_max_pages": 3,
                             "prefill": prefill}))
    return p


@pytest.fixture(scope="module", params=[(m, p) for m in MODES for p in ("sparse", "dense")],
                ids=lambda x: f"{x[0].split(':')[0]}-{x[1]}")
def servers(request, tmp_path_factory):
    spec = _spec(tmp_path_factory.mktemp("cp"), *request.param)
    procs = [start([f"--model-file={spec}", "--cache-dtype=fp32"], kv_pages=48, threads=1)
             for _ in range(4)]
    yield [p[1] for p in procs]
    for p in procs:
        p[0].send_signal(signal.SIGTERM)
    for p in procs:
        assert p[0].wait(timeout=30) == 0


def _layer(spec, kind, T, rng):
    return random_layer(spec, kind, T, rng)


@pytest.mark.parametrize("parts", [2, 3])
def test_a_split_sequence_equals_one_server(servers, parts):
    rng = np.random.default_rng(parts)
    sid = f"cp-{parts}"
    clients = [AttndClient(t, timeout=60) for t in servers]
    whole, split = clients[3], clients[:parts]
    spec = whole.info().model
    starts = [0, 48] if parts == 2 else [0, 32, 64]
    seq = ContextParallelSequence(split, starts, sid)
    seq.open()
    whole.open_sequence(sid)
    # Prefill in chunks ending at the boundaries (one crossing none), then decode on the last.
    steps = [30, 18, 20, 1, 1, 1] if parts == 2 else [32, 20, 12, 9, 1, 1]
    worst, sparse = 0.0, 0
    try:
        for T in steps:
            layers = [_layer(spec, kind, T, rng) for kind in spec.layers]
            got = seq.step(T, layers, attended=True)
            st = whole.begin_step([(sid, T)])
            for i, x in enumerate(layers):
                ref = whole.attend_layer_details(st.step_id, LayerInputs(
                    i, return_lse=True, return_attended=True, **x))
                g = got[i]
                assert g.out.shape == ref.out.shape and not np.isnan(g.out).any()
                err = float(np.linalg.norm(g.out.astype(np.float64) - ref.out) /
                            np.linalg.norm(ref.out))
                assert err <= 1e-5, (T, i, err)
                worst = max(worst, err)
                np.testing.assert_allclose(g.lse, ref.lse, rtol=1e-5, atol=1e-5)
                for t in range(T):
                    np.testing.assert_array_equal(g.attended[t], ref.attended[t])
                    if spec.layers[i] != "dense":
                        sparse += len(ref.attended[t]) < ref.attended[t][-1] + 1
        assert worst > 0  # two summation orders: the comparison is live
        assert seq.length == whole.describe_sequence(sid).length == sum(steps)
        for k, c in enumerate(split):  # each server holds exactly its slice
            hi = starts[k + 1] if k + 1 < parts else sum(steps)
            assert c.describe_sequence(sid).length == hi - starts[k]
        assert sparse > 0, "no query attended a real selection"
    finally:
        seq.close()
        whole.close_sequence(sid)
        for c in clients:
            c.close()


def test_a_failed_step_leaves_every_server_as_it_was(servers):
    rng = np.random.default_rng(9)
    clients = [AttndClient(t, timeout=30) for t in servers[:3]]
    spec = clients[0].info().model
    seq = ContextParallelSequence(clients, [0, 32, 64], "cp-fail")
    seq.open()
    try:
        seq.step(32, [_layer(spec, k, 32, rng) for k in spec.layers])
        seq.step(4, [_layer(spec, k, 4, rng) for k in spec.layers])
        bad = [_layer(spec, k, 2, rng) for k in spec.layers]
        bad[2]["q_latent"][0, 0, 0] = np.nan  # the last full layer's queries: refused there
        with pytest.raises(Exception) as e:
            seq.step(2, bad)
        assert "NaN" in str(e.value) or "finite" in str(e.value), e.value
        assert [c.describe_sequence("cp-fail").length for c in clients] == [32, 4, 0]
        assert seq.length == 36
        with pytest.raises(ValueError, match="split the chunk"):
            seq.step(40, [_layer(spec, k, 40, rng) for k in spec.layers])
        out = seq.step(1, [_layer(spec, k, 1, rng) for k in spec.layers])  # still serving
        assert all(np.isfinite(o.out).all() for o in out)
    finally:
        seq.close()
        for c in clients:
            c.close()


def test_open_refuses_servers_that_cannot_serve_it(servers, tmp_path):
    clients = [AttndClient(t, timeout=30) for t in servers[:2]]
    assert all(c.info().context_parallel for c in clients)
    with pytest.raises(ValueError, match="multiple of the page size"):
        ContextParallelSequence(clients, [0, 20], "cp-misaligned").open()
    window = tmp_path / "window.json"
    window.write_text(json.dumps({"base": "tiny", "name": "w", "layers": "FSFD",
                                  "sliding_window": 40}))
    proc, target, _ = start([f"--model-file={window}"], kv_pages=16, threads=1)
    try:
        with AttndClient(target, timeout=30) as w:
            assert not w.info().context_parallel
            with pytest.raises(ValueError, match="does not serve it"):
                ContextParallelSequence([clients[0], w], [0, 32], "cp-window").open()
            assert w.list_sequences() == [] and clients[0].list_sequences() == []
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        for c in clients:
            c.close()


def test_a_context_parallel_step_over_the_stream(servers):
    """One server holding a slice that starts at 0 (its own candidates are the merge): over the
    stream, candidates then the selection with the queries equal an ordinary step on the same
    inputs, bit for bit."""
    rng = np.random.default_rng(13)
    with AttndClient(servers[0], timeout=30) as c:
        spec = c.info().model
        for sid in ("st-cp", "st-plain"):
            c.open_sequence(sid)
        try:
            for T in (30, 1):
                layers = [_layer(spec, kind, T, rng) for kind in spec.layers]
                with c.stream() as s:
                    s.begin([("st-plain", T)])
                    want = [s.layer_details(LayerInputs(i, return_lse=True, **x))
                            for i, x in enumerate(layers)]
                with c.stream() as s:
                    s.begin([("st-cp", T)], position_offsets=[0])
                    got = []
                    for i, x in enumerate(layers):
                        if "index_q" in x:
                            cand = s.layer_candidates(LayerInputs(
                                i, **{k: v for k, v in x.items() if not k.startswith("q_")}))
                            assert isinstance(cand, Candidates) and len(cand.count) == T
                            x = {k: x[k] for k in ("q_latent", "q_rope")}
                            got.append(s.layer_details(LayerInputs(
                                i, selection=merge_candidates([cand]), return_lse=True, **x)))
                        else:
                            got.append(s.layer_details(LayerInputs(i, return_lse=True, **x)))
                for g, w in zip(got, want):
                    np.testing.assert_array_equal(g.out, w.out)
                    np.testing.assert_array_equal(g.lse, w.lse)
            assert c.describe_sequence("st-cp").length == 31
        finally:
            c.close_sequence("st-cp")
            c.close_sequence("st-plain")


def test_merge_candidates_against_a_float64_sort():
    rng = np.random.default_rng(4)
    T, keep = 5, 6
    parts = []
    for k in range(3):
        count = rng.integers(0, 8, T).astype(np.int32)
        n = int(count.sum())
        # Keys of part k are k*100 + a distinct offset; scores with ties.
        keys = np.concatenate([k * 100 + rng.permutation(50)[:c] for c in count]).astype(np.int64)
        scores = np.round(rng.standard_normal(n), 1).astype(np.float32)
        parts.append(Candidates(pages=False, keep=keep, count=count, keys=keys, scores=scores))
    m = merge_candidates(parts)
    at = [0, 0, 0]
    pos = 0
    for t in range(T):
        allk = []
        for k, p in enumerate(parts):
            c = int(p.count[t])
            allk += [(-float(p.scores[at[k] + j]), int(p.keys[at[k] + j])) for j in range(c)]
            at[k] += c
        want = sorted(allk)[:keep]
        c = int(m.count[t])
        assert c == len(want)
        assert [(-float(s), int(x)) for s, x in zip(m.scores[pos:pos + c], m.keys[pos:pos + c])] \
            == want
        pos += c
    with pytest.raises(ValueError):
        merge_candidates([parts[0], Candidates(False, keep + 1, parts[1].count, parts[1].keys,
                                               parts[1].scores)])
