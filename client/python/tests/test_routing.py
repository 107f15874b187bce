"""Routing through membership changes with attnd.Router against real attnd replicas named with
--replica-name: a decode workload keeps stepping while one replica drains, comes back under a new
address, and a fourth joins. No step fails (a miss is located and retried), every sequence ends on
the replica its name-hash picks, and each decode output is bit-identical to that of a twin
sequence on a server outside the fleet that never moved. With change_replicas and rebalance, a
replica joins a loaded fleet and another leaves it without a single misrouted step."""

from __future__ import annotations

import signal

import grpc
import numpy as np

from attnd import AttndClient, AttndError, Router, name_replicas, ranked, route

from attnd_process import start
from attnd_testlib import bf16_layers, run_step

NAMES = ["attnd-0", "attnd-1", "attnd-2", "attnd-3"]


def _replica(name, extra=()):
    proc, target, _ = start([f"--replica-name={name}", "--step-idle-timeout-ms=20000", *extra],
                            kv_pages=300, threads=1)
    return proc, target


def _close(router, twin, procs):
    router.close()
    twin.close()
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)


def _bits(outputs):
    return [np.asarray(o).view(np.uint16).copy() for o in outputs]


def test_ranked_and_names():
    ids = [f"x{i}" for i in range(50)]
    for s in ids:
        order = ranked(NAMES, s)
        assert order[0] == route(NAMES, s)
        assert order[1] == route([n for n in NAMES if n != order[0]], s)


def test_decode_through_a_drain_a_rejoin_and_a_scale_up():
    twin_proc, twin_target = _replica("twin")
    p0, t0 = _replica("attnd-0")
    p2, t2 = _replica("attnd-2")
    p1, t1 = _replica("attnd-1", [f"--drain-peers={t0},{t2}", "--drain-timeout-ms=20000"])
    procs = [twin_proc, p0, p1, p2]
    twin = AttndClient(twin_target, timeout=30.0)
    router = Router(name_replicas([t0, t1, t2]), timeout=30.0)
    try:
        assert router.replicas() == {"attnd-0": t0, "attnd-1": t1, "attnd-2": t2}
        spec = twin.info().model
        rng = np.random.default_rng(5)
        seqs = [f"conv-{i}" for i in range(16)]
        on_1 = [s for s in seqs if router.pick(s) == "attnd-1"]
        on_3 = [s for s in seqs if route(NAMES, s) == "attnd-3"]
        assert len(on_1) >= 2 and len(on_3) >= 2, (on_1, on_3)
        length = {}
        for s in seqs:
            router.client_for(s).open_sequence(s)
            twin.open_sequence(s)
            x = bf16_layers(spec, 13, rng)
            run_step(router.client_for(s), s, x)
            run_step(twin, s, x)
            length[s] = 13
        misses = 0

        def decode_round():
            nonlocal misses
            for s in seqs:
                x = bf16_layers(spec, 1, rng)
                want = _bits(run_step(twin, s, x))
                c = router.client_for(s)
                for _ in range(2000):  # a sequence being drained is nowhere for a moment
                    try:
                        got = _bits(run_step(c, s, x))
                        break
                    except AttndError as e:
                        assert e.code in (grpc.StatusCode.NOT_FOUND,
                                          grpc.StatusCode.UNAVAILABLE), e
                        misses += 1
                        try:
                            c = router.locate(s)
                        except AttndError as e2:
                            assert e2.code == grpc.StatusCode.NOT_FOUND, e2
                else:
                    raise AssertionError(f"{s}: no replica took the step")
                for layer, (g, w) in enumerate(zip(got, want)):
                    assert np.array_equal(g, w), (s, layer)
                length[s] += 1

        decode_round()
        p1.send_signal(signal.SIGTERM)  # attnd-1 drains mid-workload
        decode_round()
        assert p1.wait(timeout=60) == 0
        router.set_replicas({"attnd-0": t0, "attnd-2": t2})
        decode_round()

        p1b, t1b = _replica("attnd-1")  # back under a new address
        procs.append(p1b)
        assert t1b != t1
        router.set_replicas(name_replicas([t0, t1b, t2]))
        pulls = router.pulls
        decode_round()
        assert router.pulls - pulls == len(on_1), "attnd-1's sequences came home"

        p3, t3 = _replica("attnd-3")  # scale-up
        procs.append(p3)
        router.set_replicas(name_replicas([t0, t1b, t2, t3]))
        pulls = router.pulls
        decode_round()
        assert router.pulls - pulls == len(on_3), "the new replica took its share"
        assert misses > 0

        members = router.replicas()
        for s in seqs:
            owner = router.pick(s)
            for name, target in members.items():
                with AttndClient(target) as c:
                    if name == owner:
                        assert c.describe_sequence(s).length == length[s], s
                    else:
                        try:
                            c.describe_sequence(s)
                            raise AssertionError(f"{s} also on {name}")
                        except AttndError as e:
                            assert e.code == grpc.StatusCode.NOT_FOUND
    finally:
        _close(router, twin, procs)


def test_a_replica_joins_and_one_leaves_a_loaded_fleet_without_a_misrouted_step():
    # Router.change_replicas keeps each sequence whose owner changes where it is; rebalance,
    # between steps, moves it (the sequence importer) and routes it there: no step ever reaches a
    # replica that does not hold its sequence. Outputs bit for bit a twin that never moved.
    twin_proc, twin_target = _replica("twin")
    p0, t0 = _replica("attnd-0")
    p1, t1 = _replica("attnd-1")
    procs = [twin_proc, p0, p1]
    twin = AttndClient(twin_target, timeout=30.0)
    router = Router(name_replicas([t0, t1]), timeout=30.0)
    try:
        spec = twin.info().model
        rng = np.random.default_rng(9)
        seqs = [f"load-{i}" for i in range(18)]
        for s in seqs:
            router.client_for(s).open_sequence(s)
            twin.open_sequence(s)
            x = bf16_layers(spec, 21, rng)
            run_step(router.client_for(s), s, x)
            run_step(twin, s, x)

        def decode_round():  # any error (a miss included) fails the test
            for s in seqs:
                x = bf16_layers(spec, 1, rng)
                want = _bits(run_step(twin, s, x))
                got = _bits(run_step(router.client_for(s), s, x))
                for layer, (g, w) in enumerate(zip(got, want)):
                    assert np.array_equal(g, w), (s, layer)

        def holders(s, members):
            found = []
            for name, target in members.items():
                with AttndClient(target) as c:
                    try:
                        c.describe_sequence(s)
                        found.append(name)
                    except AttndError as e:
                        assert e.code == grpc.StatusCode.NOT_FOUND, e
            return found

        decode_round()
        p2, t2 = _replica("attnd-2")  # joins
        procs.append(p2)
        three = name_replicas([t0, t1, t2])
        moving = router.change_replicas(three, seqs)
        assert sorted(moving) == sorted(s for s in seqs if route(three, s) == "attnd-2")
        assert moving, "the new replica has a share"
        decode_round()  # before the moves: where they were
        assert router.rebalance() == len(moving) and not router.moving()
        decode_round()
        for s in seqs:
            assert holders(s, three) == [route(three, s)], s

        two = {"attnd-1": t1, "attnd-2": t2}  # attnd-0 leaves
        moving = router.change_replicas(two, seqs)
        assert sorted(moving) == sorted(s for s in seqs if route(three, s) == "attnd-0")
        decode_round()  # still on attnd-0, which is out of the membership already
        assert router.rebalance() == len(moving)
        decode_round()
        for s in seqs:
            assert holders(s, three) == [route(two, s)], s
        p0.send_signal(signal.SIGTERM)  # nothing of the workload left on it
        assert p0.wait(timeout=60) == 0
        decode_round()
        assert router.pulls == 0, "no step ever missed"
    finally:
        _close(router, twin, procs)


def test_a_sequence_locate_found_elsewhere_is_routed_there_from_then_on():
    # Issue 53 (pins kept wrongly): a sequence pinned where it was (change_replicas, or a
    # failover) and moved meanwhile by someone else (here by hand, as a drain would) misses once;
    # locate finds it, and from then on the router routes it there, its pin and pending move
    # dropped — not back to the old pin, missing on every step.
    p0, t0 = _replica("attnd-0")
    p1, t1 = _replica("attnd-1")
    router = Router({"attnd-0": t0}, timeout=30.0)
    try:
        two = {"attnd-0": t0, "attnd-1": t1}
        sid = next(f"pin-{i}" for i in range(100) if route(two, f"pin-{i}") == "attnd-1")
        a = router.client_for(sid)
        a.open_sequence(sid)
        spec = a.info().model
        rng = np.random.default_rng(3)
        run_step(a, sid, bf16_layers(spec, 9, rng))
        assert router.change_replicas(two, [sid]) == [sid]
        assert router.pick(sid) == "attnd-0"
        with AttndClient(t1) as b:
            a.handoff(sid, b, close_source=True)  # moved behind the router's back
        try:
            run_step(router.client_for(sid), sid, bf16_layers(spec, 1, rng))
            raise AssertionError("the step should have missed on attnd-0")
        except AttndError as e:
            assert e.code == grpc.StatusCode.NOT_FOUND, e
        c = router.locate(sid)
        run_step(c, sid, bf16_layers(spec, 1, rng))
        assert router.pick(sid) == "attnd-1"
        assert router.moving() == {}
        run_step(router.client_for(sid), sid, bf16_layers(spec, 1, rng))  # no second miss
        assert router.rebalance() == 0
    finally:
        router.close()
        for p in (p0, p1):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
