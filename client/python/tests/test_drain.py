"""Drain (docs/lifecycle.md) against three real attnd on loopback: SIGTERM one in the middle of a
decode workload. Its readiness turns NOT_SERVING at once, the workload sees nothing but UNAVAILABLE
from it, every sequence it held appears on the peer the rendezvous hash picks over the remaining
replicas, the next decode outputs of each moved sequence are bit-identical to those of a twin that
never moved, and the drained process exits 0."""

from __future__ import annotations

import signal
import time

import grpc
import ml_dtypes
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attnd import AttndClient, AttndError, LayerInputs
from attnd import route as route_names
from attnd.v1 import attention_pb2 as pb

from attnd_process import start
from attnd_testlib import bf16_layers as _inputs
from attnd_testlib import run_step as _step

BF16 = ml_dtypes.bfloat16


def _start(extra):
    proc, target, _ = start(extra, kv_pages=400, threads=1)
    return proc, target


def _ready(target) -> bool:
    with grpc.insecure_channel(target) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="attnd.v1.Attention"), timeout=5)
        return resp.status == health_pb2.HealthCheckResponse.SERVING


def test_sigterm_hands_every_sequence_to_the_peer_the_hash_picks():
    b, tb = _start([])
    c, tc = _start([])
    a, ta = _start([f"--drain-peers={tb},{tc}", "--drain-timeout-ms=20000",
                    "--step-idle-timeout-ms=20000"])
    procs = {ta: a, tb: b, tc: c}
    clients = {t: AttndClient(t, timeout=30.0) for t in procs}
    try:
        spec = clients[ta].info().model
        rng = np.random.default_rng(3)
        everyone = [ta, tb, tc]
        # The hash runs over the replicas' names (HOST:PORT without --replica-name), as the drain's.
        target_of = {clients[t].info().replica_name: t for t in everyone}
        assert len(target_of) == 3, target_of

        def route(targets, s):
            return target_of[route_names([n for n, t in target_of.items() if t in targets], s)]

        # Sequences routed over all three; each has a twin on a replica that stays, fed the same
        # inputs, so its outputs say what the moved sequence must answer.
        seqs = [f"drain-{i}" for i in range(24)]
        # At least 3 on the drained replica, whatever names (ports) the replicas got this run
        # (24 ids left 2 or fewer there about once in 200 runs).
        more = (f"drain-a{i}" for i in range(100000))
        while sum(route(everyone, s) == ta for s in seqs) < 3:
            seqs.append(next(s for s in more if route(everyone, s) == ta))
        on_a = [s for s in seqs if route(everyone, s) == ta]
        home = {s: route(everyone, s) for s in seqs}
        twin_home = {s: route([tb, tc], s + "-twin") for s in seqs}
        for s in seqs:
            clients[home[s]].open_sequence(s)
            clients[twin_home[s]].open_sequence(s + "-twin")
            prompt = _inputs(spec, 37, rng)
            _step(clients[home[s]], s, prompt)
            _step(clients[twin_home[s]], s + "-twin", prompt)
        assert _ready(ta)

        moved = set()
        for k in range(6):
            early = {}
            if k == 2:  # mid-workload, with a step of the drained replica open
                s0 = on_a[0]
                x0 = _inputs(spec, 1, rng)
                open_step = clients[ta].begin_step([(s0, 1)])
                first = clients[ta].attend_layer(open_step.step_id, LayerInputs(0, **x0[0]))
                a.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 10
                while _ready(ta):  # the drain waits for the open step: the server stays up
                    assert time.monotonic() < deadline, "readiness never turned NOT_SERVING"
                    time.sleep(0.01)
                # The open step may finish on the draining replica.
                rest = [clients[ta].attend_layer(open_step.step_id, LayerInputs(i, **x))
                        for i, x in enumerate(x0) if i > 0]
                early[s0] = (x0, [first] + rest)
            for s in seqs:
                if s in early:
                    x, got = early[s]
                    twin = _step(clients[twin_home[s]], s + "-twin", x)
                    for layer, (g, t) in enumerate(zip(got, twin)):
                        assert np.array_equal(np.asarray(g).view(np.uint16),
                                              np.asarray(t).view(np.uint16)), (s, k, layer)
                    continue
                x = _inputs(spec, 1, rng)
                twin = _step(clients[twin_home[s]], s + "-twin", x)
                try:
                    got = _step(clients[home[s]], s, x)
                except AttndError as e:
                    assert home[s] == ta and e.code == grpc.StatusCode.UNAVAILABLE, (s, e)
                    # Re-route over the replicas that remain and wait for the handoff.
                    home[s] = route([tb, tc], s)
                    moved.add(s)
                    deadline = time.monotonic() + 20
                    while True:
                        try:
                            d = clients[home[s]].describe_sequence(s)
                            if not d.importing and not d.in_step:
                                break
                        except AttndError as e2:
                            assert e2.code == grpc.StatusCode.NOT_FOUND, e2
                        assert time.monotonic() < deadline, f"{s} never appeared on {home[s]}"
                        time.sleep(0.01)
                    got = _step(clients[home[s]], s, x)
                for layer, (g, t) in enumerate(zip(got, twin)):
                    assert np.array_equal(np.asarray(g).view(np.uint16),
                                          np.asarray(t).view(np.uint16)), (s, k, layer)
        assert moved == set(on_a), "every sequence of the drained replica moved, and only those"
        assert a.wait(timeout=60) == 0, "the drained process exits 0"
        out = a.stdout.read()
        assert f"drained: {len(on_a)} sequence(s) handed to 2 peer(s), 0 left behind" in out, out
        for s in seqs:
            assert clients[home[s]].describe_sequence(s).length == 37 + 6
    finally:
        for t, p in procs.items():
            clients[t].close()
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)


def test_the_drain_rpc_starts_the_same_drain(tmp_path):
    b, tb = _start([])
    a, ta = _start([f"--drain-peers={tb}"])  # a Drain call names configured peers only
    try:
        with AttndClient(ta, timeout=30.0) as ca, AttndClient(tb, timeout=30.0) as cb:
            spec = ca.info().model
            ca.open_sequence("rpc-drain")
            _step(ca, "rpc-drain", _inputs(spec, 20, np.random.default_rng(4)))
            ca.drain([tb])
            assert a.wait(timeout=60) == 0
            d = cb.describe_sequence("rpc-drain")
            assert (d.length, d.importing) == (20, False)
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)


def test_a_drain_keeps_each_sequence_in_its_tenant(tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("drain-token-a-01234567 a\ndrain-token-b-01234567 b\n"
                      "drain-token-ops-0123456 ops\n")
    admin = tmp_path / "admin.token"
    admin.write_text("drain-token-ops-0123456\n")
    auth = ["--auth=token", f"--auth-tokens={tokens}", "--admin-tenant=ops"]
    b, tb = _start(auth)
    a, ta = _start(auth + [f"--drain-peers={tb}", f"--drain-token-file={admin}"])
    try:
        ca = AttndClient(ta, timeout=30.0, token="drain-token-a-01234567")
        cb_a = AttndClient(tb, timeout=30.0, token="drain-token-a-01234567")
        cb_b = AttndClient(tb, timeout=30.0, token="drain-token-b-01234567")
        spec = ca.info().model
        ca.open_sequence("tenant-seq")
        _step(ca, "tenant-seq", _inputs(spec, 11, np.random.default_rng(5)))
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=60) == 0
        assert cb_a.describe_sequence("tenant-seq").length == 11  # a's, on b's server
        with pytest.raises(AttndError) as e:
            cb_b.describe_sequence("tenant-seq")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        for c in (ca, cb_a, cb_b):
            c.close()
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)


def test_a_drained_or_handed_off_sequence_keeps_its_generation():
    """A sequence that failed over (generation 2) moves on at generation 2, so its workers'
    fencing holds on the peer: a step naming 2 is served there, one naming 1 is refused."""
    b, tb = _start([])
    c, tc = _start([])
    a, ta = _start([f"--drain-peers={tb}"])
    try:
        with AttndClient(ta, timeout=30.0) as ca, AttndClient(tb, timeout=30.0) as cb, \
                AttndClient(tc, timeout=30.0) as cc:
            spec = ca.info().model
            rng = np.random.default_rng(6)
            ca._unary("OpenSequence", pb.OpenSequenceRequest(sequence_id="failed-over",
                                                             standby_generation=1), lambda r: r)
            assert ca.promote_sequence("failed-over", 1, 0).generation == 2
            _step(ca, "failed-over", _inputs(spec, 9, rng))
            ca.drain([tb])
            assert a.wait(timeout=60) == 0
            d = cb.describe_sequence("failed-over")
            assert (d.length, d.generation, d.importing) == (9, 2, False)
            with pytest.raises(AttndError) as e:
                cb.begin_step([("failed-over", 1)], generations=[1])
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "fenced" in e.value.details
            step = cb.begin_step([("failed-over", 1)], generations=[2])
            cb.abort_step(step.step_id)
            # A handoff by the client keeps it too.
            assert cb.handoff("failed-over", cc).generation == 2
            assert cc.describe_sequence("failed-over").generation == 2
            # A generation past 2^62, or on a fork or a prompt's open, is refused.
            for bad in ({"import_generation": (1 << 62) + 1},
                        {"fork_parent": "failed-over", "prefix_len": 4, "import_generation": 2},
                        {"prompt_token_ids": [1, 2, 3], "import_generation": 2}):
                with pytest.raises(AttndError) as e:
                    cc.open_sequence("bad", **bad)
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, bad
    finally:
        for p in (a, b, c):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)
