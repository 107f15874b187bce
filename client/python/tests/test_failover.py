"""Standby replicas (docs/replication.md) against three real attnd on loopback, each with
--standby-peers naming all three: a decode workload across them, the primary of some sequences
killed with SIGKILL at a random point (between steps, in the middle of a step, while the last
layer's reply is in flight, during a fork), every sequence failed over by attnd.Router to its
standby and its outputs from then on bit-identical to a twin on a replica that never failed.
`sync`: nothing committed is lost. `async`: what is lost is at most the lag the replica reported
(a standby held back with SIGSTOP builds one). A primary that was only paused cannot make its
late steps count: they are fenced."""

from __future__ import annotations

import re
import signal
import time

import grpc
import numpy as np
import pytest
from replication_cluster import (
    Cluster,
    Seq,
    _in_thread,
    _lag,
    _pause_caught_up_standby,
    _protection,
    _standby_copy,
    pause,
)

from attnd import AttndClient, AttndError, LayerInputs, ranked

from attnd_process import start
from attnd_testlib import bf16_layers, run_sharded, scrape, wait_for


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("when", ["between-steps", "mid-step", "mid-reply", "mid-fork"])
def test_a_killed_primary_loses_no_committed_step(tmp_path, mode, when):
    # A killed primary ends its lease at once (its port refuses connections), so a long lease
    # costs this test nothing; the default 2 s lapsed on a loaded 2-core machine when the
    # standby's answers were late: the step was refused, the harness failed a live primary over,
    # and its bookkeeping broke (CI, and 7 runs in 20 under three CPU burners). What a lease
    # bounds is test_partition's.
    c = Cluster(tmp_path, mode, extra=["--replication-lease-ms=10000"])
    try:
        rng = np.random.default_rng(hash((mode, when)) % 2**32)
        seqs = [c.open(f"{mode}-{when}-{i}") for i in range(9)]
        for s in seqs:
            c.step(s, T=37)
        victim = c.router.pick(seqs[0].sid)
        on_victim = [s for s in seqs if c.router.pick(s.sid) == victim]
        kill_at = int(rng.integers(1, 4))
        lag = 0
        for k in range(6):
            if k == kill_at:
                s0 = on_victim[0]
                client = c.router.client_for(s0.sid)
                if when == "between-steps":
                    lag = _lag(c.mports[c.address_of[victim]])
                    c.kill(victim)
                elif when in ("mid-step", "mid-reply"):
                    x = bf16_layers(c.spec, 1, rng)
                    step = client.begin_step([(s0.sid, 1)], generations=[s0.generation])
                    cut = int(rng.integers(0, len(x) - 1)) if when == "mid-step" else len(x) - 1
                    for i in range(cut):
                        client.attend_layer(step.step_id, LayerInputs(i, **x[i]))
                    lag = _lag(c.mports[c.address_of[victim]])
                    if when == "mid-reply":  # the last layer on its way: committed or not
                        t, _ = _in_thread(client.attend_layer, step.step_id,
                                          LayerInputs(cut, **x[cut]))
                        time.sleep(float(rng.uniform(0, 0.004)))
                        c.kill(victim)
                        t.join()
                    else:
                        c.kill(victim)
                    # The worker never saw the step confirmed: it runs it again after failover
                    # (the standby is cut back to what the worker knows when it got further).
                    c.step(s0, x=x)
                else:  # mid-fork
                    child = Seq(f"{s0.sid}-child", length=s0.length, history=list(s0.history))
                    lag = _lag(c.mports[c.address_of[victim]])
                    t, result = _in_thread(client.open_sequence, child.sid, s0.sid, s0.length)
                    time.sleep(float(rng.uniform(0, 0.004)))
                    c.kill(victim)
                    t.join()
                    if not isinstance(result.get("r"), AttndError):  # the fork answered
                        c.twin.open_sequence(child.sid, s0.sid, s0.length)
                        try:
                            c.fail_over(child, failed=victim)
                            seqs.append(child)
                        except AttndError as e:  # its copy was not made yet (unprotected)
                            assert e.code == grpc.StatusCode.NOT_FOUND, e
            for s in seqs:
                if k == kill_at and c.router.pick(s.sid) == victim:
                    before = s.length
                    lost = c.fail_over(s, failed=victim)
                    if mode == "sync":
                        assert lost == 0, f"{s.sid}: sync lost {lost} committed step(s)"
                    else:
                        assert lost <= max(lag, 0), (s.sid, lost, lag)
                    assert s.length == before
                c.step(s)
        for s in seqs:  # every sequence where the router says, as long as the worker knows
            d = c.router.client_for(s.sid).describe_sequence(s.sid)
            assert (d.length, d.standby) == (s.length, False), (s.sid, d)
            assert d.generation == s.generation
        assert c.router.failovers >= len(on_victim)
    finally:
        c.close()


def _tier_bytes(mport: int, to: str) -> float:
    """Bytes attnd copied into tier ``to`` so far (attnd_tier_bytes_total, every source)."""
    return sum(float(v) for v in re.findall(
        rf'^attnd_tier_bytes_total{{from="\w+",to="{to}"}} (\S+)$', scrape(mport), re.M))


def test_spilled_sequences_are_copied_from_where_they_are_and_fail_over(tmp_path):
    # Replicas whose devices hold a few sequences, the rest on their host and disk tiers. A
    # standby dies: its sequences' primaries copy them whole to the next replica, reading the
    # spilled ones where they are (nothing comes back to a device for it), in steps the new
    # standby's small device can take; a copy counts as protected only once it holds every row
    # (a copy left out of a round for the step's token budget was counted caught up, and sync
    # failover lost its steps). Then a primary dies and its sequences, spilled ones among them,
    # fail over bit for bit with nothing lost (sync).
    probe, target, _ = start([], kv_pages=64)
    with AttndClient(target) as p:
        page_bytes = p.info().devices[0].bytes_per_page
    probe.kill()
    probe.wait(timeout=10)
    tiers = [f"--host-cache-bytes={8 * page_bytes}", f"--disk-cache-dir={tmp_path}",
             f"--disk-cache-bytes={400 * page_bytes}"]
    c = Cluster(tmp_path, "sync", extra=tiers, kv_pages=1 + 12)
    try:
        seqs = [c.open(f"tiered-{i}") for i in range(30)]
        for s in seqs:
            c.step(s, T=37)  # 3 pages each: a device holds 4
        for s in seqs:
            c.step(s)
        # The primary and standby pair most sequences have.
        pairs = {}
        for s in seqs:
            pairs.setdefault(tuple(ranked(c.names, s.sid)[:2]), []).append(s.sid)
        (victim, dead_standby), recopied = max(pairs.items(), key=lambda kv: len(kv[1]))
        survivor = next(n for n in c.names if n not in (victim, dead_standby))
        with AttndClient(c.address_of[victim]) as v:
            where = {x.sequence_id: x.tier for x in v.list_sequences() if not x.standby}
            assert any(where[sid] != "device" for sid in recopied), where
            mport = c.mports[c.address_of[victim]]
            onto_device = _tier_bytes(mport, "device")
            c.kill(dead_standby)
            # Every sequence the victim leads gets its copy on the survivor, whole again.
            wait_for(lambda: all(v.describe_sequence(sid).standby_replica == survivor
                                 for sid in recopied), "copies go to the next replica", 30)
            wait_for(lambda: re.search(r'^attnd_replication_sequences{state="unprotected"} 0$',
                                       scrape(mport), re.M), "the new copies caught up", 30)
            assert _tier_bytes(mport, "device") == onto_device, "a copy restored a sequence"
            with AttndClient(c.address_of[survivor]) as sv:  # protected: every row is there
                for sid in recopied:
                    assert sv.describe_sequence(sid).length == v.describe_sequence(sid).length, sid
        c.kill(victim)
        for s in seqs:
            if s.sid in recopied:
                assert c.fail_over(s, failed=victim) == 0, f"{s.sid}: sync lost a step"
                c.step(s)  # on the survivor, as the twin answers
                c.step(s, T=5)
    finally:
        c.close()


def test_a_sequence_opened_on_cached_blocks_is_copied_whole_and_fails_over(tmp_path):
    # The prefix cache and standbys: a sequence opened on the blocks a closed one left holds rows
    # no step of its own wrote; its standby copy is made whole from the cache, its commits wait
    # for it (sync), and with its primary killed it fails over bit for bit, nothing lost.
    c = Cluster(tmp_path, "sync")
    try:
        P = c.spec.page_size
        rng = np.random.default_rng(5)
        shared = [int(t) for t in rng.integers(0, 150000, 2 * P)]
        a, b = "donor", next(f"cached-{i}" for i in range(100)
                             if c.router.pick(f"cached-{i}") == c.router.pick("donor"))
        primary = c.router.pick(a)
        client = c.router.client_for(a)
        client.open_sequence(a, prompt_token_ids=shared + [1, 2, 3])
        prefix = bf16_layers(c.spec, 2 * P, rng)
        c._run(client, Seq(a), prefix)
        c._run(client, Seq(a, length=2 * P), bf16_layers(c.spec, 3, rng))
        client.close_sequence(a)
        info = client.open_sequence(b, prompt_token_ids=shared + [4, 5])
        assert (info.cached_tokens, info.length) == (2 * P, 2 * P), info
        c.twin.open_sequence(b)
        c._run(c.twin, Seq(b), prefix)  # the twin prefills those rows cold
        s = Seq(b, length=2 * P)
        mport = c.mports[c.address_of[primary]]
        wait_for(lambda: re.search(r'^attnd_replication_sequences{state="unprotected"} 0$',
                                   scrape(mport), re.M), "the cached rows' copy is made", 30)
        with AttndClient(c.address_of[ranked(c.names, b)[1]]) as standby:
            assert standby.describe_sequence(b).length == 2 * P
        c.step(s, T=2)
        c.step(s)
        c.kill(primary)
        assert c.fail_over(s, failed=primary) == 0, "sync lost a step"
        # The promoted copy's blocks came with its rows (issue 53): the new primary's prefix
        # cache holds them and announced them.
        with AttndClient(c.address_of[ranked(c.names, b)[1]]) as promoted:
            assert promoted.lookup_prefix(token_ids=shared + [4, 5]).cached_blocks == 2
        # The promoted copy's tokens count as kept by a failover, under vLLM's source name too.
        text = scrape(c.mports[c.address_of[ranked(c.names, b)[1]]])
        for series in ('attnd_prompt_tokens_cached_by_source_total{source="standby"}',
                       'attnd_prompt_tokens_by_source_total{source="external_kv_transfer"}'):
            assert re.search(rf"^{re.escape(series)} {s.length}$", text, re.M), (series, s.length)
        for T in (1, 1, 4):
            c.step(s, T=T)
    finally:
        c.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_commit_replies_say_where_their_rows_stand(tmp_path, mode):
    """LayerOutput.protection: per batch entry, in order; "replicated" (sync) or "shipping"
    (async) once a sequence's copy has caught up, "unprotected" while its standby does not
    acknowledge; nothing on a replica without standbys."""
    c = Cluster(tmp_path, mode)
    try:
        # Two sequences with one primary (a batch steps on one replica), different standbys or not.
        first = ranked(c.names, "prot-0")[0]
        sids = [f"prot-{i}" for i in range(200) if ranked(c.names, f"prot-{i}")[0] == first][:2]
        seqs = [c.open(sid) for sid in sids]
        client = c.router.client_for(sids[0])
        for s in seqs:
            c.step(s, T=9)
        for s in seqs:
            with AttndClient(c.address_of[ranked(c.names, s.sid)[1]], timeout=10.0) as sb:
                wait_for(lambda sb=sb, s=s: _standby_copy(sb, s.sid, 1, s.length),
                         "the copy caught up")
        want = "replicated" if mode == "sync" else "shipping"
        x = bf16_layers(c.spec, 3, c.rng)
        assert _protection(client, [(seqs[0], 1), (seqs[1], 2)], x) == (want, want)
        # The first sequence's standby stops acknowledging: its commits go unprotected (sync:
        # the first, after the ack timeout; async: once the lag passes its bound of 4 and the
        # wait for the standby times out); the other's are as before when its standby is
        # another replica.
        standby = ranked(c.names, seqs[0].sid)[1]
        other = ranked(c.names, seqs[1].sid)[1]
        proc = c.procs[c.address_of[standby]]
        pause(proc)
        try:
            got = []
            for _ in range(8):
                got.append(_protection(client, [(seqs[0], 1), (seqs[1], 1)],
                                       bf16_layers(c.spec, 2, c.rng)))
                if got[-1][0] == "unprotected":
                    break
            assert got[-1][0] == "unprotected", got
            if mode == "sync":
                assert len(got) == 1, got
            else:  # within the lag bound, the commits were on their way
                assert [g[0] for g in got[:-1]] == ["shipping"] * (len(got) - 1), got
            if other != standby:
                assert got[-1][1] in ("replicated", "shipping"), got
        finally:
            proc.send_signal(signal.SIGCONT)
        # The primary counts its replies' entries by protection.
        m = scrape(c.mports[c.address_of[first]])
        count = {p: float(re.search(rf'^attnd_replication_commits_total{{protection="{p}"}} (\S+)$',
                                    m, re.M).group(1))
                 for p in ("replicated", "shipping", "unprotected")}
        assert count[want] >= 2 + len(got) - 1 and count["unprotected"] >= 1, count
        # A replica without standbys says nothing.
        twin = Seq("prot-twin")
        c.twin.open_sequence(twin.sid)
        assert _protection(c.twin, [(twin, 1)], bf16_layers(c.spec, 1, c.rng)) == ()
    finally:
        c.close()


def test_a_sharded_commit_counts_once_against_the_lag(tmp_path):
    """A sharded step commits once, though each shard's reply passes the commit hook: its
    sequence lags its standby by one commit, not one per shard."""
    c = Cluster(tmp_path, "async", ["--replication-max-lag-steps=4"])
    try:
        s = c.open("sharded")
        c.step(s, T=9)
        primary, mport, standby_proc = _pause_caught_up_standby(c, s)
        vias = [AttndClient(c.address_of[primary], timeout=10.0) for _ in range(2)]
        try:
            for n in (1, 2):
                run_sharded(vias, [(s.sid, 1)], bf16_layers(c.spec, 1, c.rng), 2)
                assert _lag(mport) == n, (n, _lag(mport))
        finally:
            standby_proc.send_signal(signal.SIGCONT)
            for v in vias:
                v.close()
        wait_for(lambda: _lag(mport) == 0, "the standby catches up again")
    finally:
        c.close()


def test_an_async_standby_loses_at_most_the_lag_it_reported(tmp_path):
    c = Cluster(tmp_path, "async", ["--replication-max-lag-steps=4"])
    try:
        s = c.open("lagging")
        c.step(s, T=37)
        primary, mport, standby_proc = _pause_caught_up_standby(c, s)
        try:
            for _ in range(3):
                c.step(s)
            wait_for(lambda: _lag(mport) == 3, "three commits unacknowledged")
            c.kill(primary)
        finally:
            standby_proc.send_signal(signal.SIGCONT)
        lost = c.fail_over(s, failed=primary)
        assert lost == 3, "the three steps it lagged by, and only those"
        for _ in range(2):
            c.step(s)
        assert c.router.client_for(s.sid).describe_sequence(s.sid).length == 37 + 3 + 2
    finally:
        c.close()
