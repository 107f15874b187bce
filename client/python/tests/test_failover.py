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
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import List

import grpc
import ml_dtypes
import numpy as np
import pytest

from attnd import AttndClient, AttndError, LayerInputs, Router, name_replicas, ranked
from attnd.v1 import attention_pb2 as pb

from attnd_process import ATTND_BIN, free_port, start
from attnd_testlib import bf16_layers, run_sharded, scrape, wait_for

BF16 = ml_dtypes.bfloat16
FAILED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
          grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED)


def bits(outs) -> List[np.ndarray]:
    return [np.asarray(o).view(np.uint16).copy() for o in outs]


@dataclass
class Seq:
    """A sequence of the workload as its worker knows it."""
    sid: str
    generation: int = 1
    length: int = 0  # confirmed committed tokens
    history: List[tuple] = field(default_factory=list)  # (start, inputs, twin output bits)


def replication_flags(addresses, mode: str, extra=()) -> List[str]:
    return [f"--standby-peers={','.join(addresses)}", f"--replication={mode}",
            "--replication-ack-timeout-ms=500", "--step-idle-timeout-ms=5000", *extra]


class Cluster:
    def __init__(self, tmp_path, mode: str, extra=(), kv_pages: int = 400):
        self.ports = [free_port() for _ in range(3)]
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        flags = replication_flags(self.addresses, mode, extra)
        self.procs, self.mports = {}, {}
        for port in self.ports:
            proc, target, mport = start(flags, port=port, kv_pages=kv_pages, threads=1,
                                        log=tmp_path / f"{mode}-{port}.log")
            self.procs[target], self.mports[target] = proc, mport
        self.join(tmp_path, mode)

    def join(self, tmp_path, mode: str) -> None:
        """The twin, the replicas' names, each resolving its two peers, the router."""
        self.twin_proc, self.twin_target, _ = start([], kv_pages=800, threads=1,
                                                    log=tmp_path / f"{mode}-twin.log")
        self.twin = AttndClient(self.twin_target, timeout=30.0)
        self.names = name_replicas(self.addresses)
        assert len(self.names) == 3, self.names
        self.address_of = dict(self.names)
        self.name_of = {a: n for n, a in self.names.items()}
        for a in self.addresses:  # every replica resolved its two peers
            with AttndClient(a, timeout=10.0) as c:
                wait_for(lambda: len(c.info().replication.peers) == 2, f"{a} resolves its peers")
        self.router = Router(self.names, timeout=1.5)
        self.spec = self.twin.info().model
        self.rng = np.random.default_rng(11)

    def kill(self, name: str) -> None:
        proc = self.procs[self.address_of[name]]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def close(self) -> None:
        self.router.close()
        self.twin.close()
        for p in [*self.procs.values(), self.twin_proc]:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=10)

    # -- the workload --

    def open(self, sid: str) -> Seq:
        info = self.router.client_for(sid).open_sequence(sid)
        assert (info.generation, info.standby) == (1, False)
        assert info.standby_replica == ranked(self.names, sid)[1], "the hash's second replica"
        self.twin.open_sequence(sid)
        return Seq(sid)

    def _run(self, client, s: Seq, x) -> list:
        T = x[0]["kv_latent"].shape[0]
        step = client.begin_step([(s.sid, T)], generations=[s.generation])
        return [client.attend_layer(step.step_id, LayerInputs(i, **xi)) for i, xi in enumerate(x)]

    def step(self, s: Seq, T: int = 1, x=None) -> None:
        """One step of `s` with the twin's output as the answer it must give; fails over when
        its primary does not answer."""
        x = x if x is not None else bf16_layers(self.spec, T, self.rng)
        T = x[0]["kv_latent"].shape[0]
        want = bits(self._run(self.twin, Seq(s.sid), x))
        for _ in range(3):
            try:
                got = bits(self._run(self.router.client_for(s.sid), s, x))
                break
            except AttndError as e:
                assert e.code in FAILED, (s.sid, e)
                self.fail_over(s)
        else:
            raise AssertionError(f"{s.sid}: no replica took the step")
        for layer, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(g, w), (s.sid, s.length, layer)
        s.history.append((s.length, x, want))
        s.length += T

    def fail_over(self, s: Seq, failed=None) -> int:
        """Promotes s's standby; resends what it lacks (checked against the twin's answers);
        returns the steps lost."""
        _, info = self.router.failover(s.sid, generation=s.generation, length=s.length,
                                       failed=failed)
        assert info.generation == s.generation + 1 and not info.standby, info
        assert info.length <= s.length, (s.sid, info.length, s.length)
        s.generation = info.generation
        lost = [h for h in s.history if h[0] >= info.length]
        assert all(h[0] + h[1][0]["kv_latent"].shape[0] <= info.length
                   for h in s.history if h[0] < info.length), "the copy ends on a step boundary"
        client = self.router.client_for(s.sid)
        for start_len, x, want in lost:  # the async lag: resent, answered as before
            got = bits(self._run(client, s, x))
            for layer, (g, w) in enumerate(zip(got, want)):
                assert np.array_equal(g, w), (s.sid, "resent", start_len, layer)
        return len(lost)


def _lag(mport: int) -> int:
    m = re.search(r"^attnd_replication_lag_steps (\S+)$", scrape(mport), re.M)
    return int(float(m.group(1)))


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("when", ["between-steps", "mid-step", "mid-reply", "mid-fork"])
def test_a_killed_primary_loses_no_committed_step(tmp_path, mode, when):
    c = Cluster(tmp_path, mode)
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


def _swallow(fn, *args):
    try:
        return fn(*args)
    except AttndError as e:
        return e


def _in_thread(fn, *args):
    """Starts fn(*args) on a thread; its result (or AttndError) lands in result["r"]."""
    result = {}

    def run():
        result["r"] = _swallow(fn, *args)

    t = threading.Thread(target=run)
    t.start()
    return t, result


def _protection(client, batch, x) -> tuple:
    """A step of ``batch`` ([(Seq, T)]) whose last layer's reply says where its commits stand."""
    step = client.begin_step([(s.sid, T) for s, T in batch],
                             generations=[s.generation for s, _ in batch])
    for i, xi in enumerate(x[:-1]):
        client.attend_layer(step.step_id, LayerInputs(i, **xi))
    last = client.attend_layer_details(step.step_id, LayerInputs(len(x) - 1, **x[-1]))
    assert last.committed
    for s, T in batch:
        s.length += T
    return last.protection


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
        proc.send_signal(signal.SIGSTOP)
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


def _pause_caught_up_standby(c: Cluster, s: Seq):
    """Waits until s's standby has every commit, then stops it (SIGSTOP: it acknowledges
    nothing from here on; the caller sends SIGCONT). Returns (primary, its metrics port, the
    standby's process)."""
    primary, standby = ranked(c.names, s.sid)[:2]
    mport = c.mports[c.address_of[primary]]
    wait_for(lambda: _lag(mport) == 0, "the standby catches up")
    standby_proc = c.procs[c.address_of[standby]]
    standby_proc.send_signal(signal.SIGSTOP)
    return primary, mport, standby_proc


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


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_paused_primarys_late_steps_are_fenced(tmp_path, mode):
    c = Cluster(tmp_path, mode)
    try:
        s = c.open(f"fenced-{mode}")
        c.step(s, T=37)
        c.step(s)
        primary, standby, third = ranked(c.names, s.sid)
        old = AttndClient(c.address_of[primary], timeout=10.0)  # a worker's stale connection
        proc = c.procs[c.address_of[primary]]
        proc.send_signal(signal.SIGSTOP)  # partitioned, not dead
        try:
            with pytest.raises(AttndError) as e:  # the worker's call times out
                c._run(c.router.client_for(s.sid), s, bf16_layers(c.spec, 1, c.rng))
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            old_generation = s.generation
            c.fail_over(s, failed=primary)
            assert c.router.pick(s.sid) == standby and s.generation == old_generation + 1
            c.step(s)
        finally:
            proc.send_signal(signal.SIGCONT)
        # The standby's new primary copies it to a new standby in the background: the third.
        with AttndClient(c.address_of[third], timeout=10.0) as t:
            wait_for(lambda: _standby_copy(t, s.sid, s.generation, s.length),
                     "a new standby copy on the third replica", timeout_s=20)
        d = c.router.client_for(s.sid).describe_sequence(s.sid)
        assert d.standby_replica == third
        # A late step at the old primary, which was paused longer than its standby's
        # acknowledgements may lapse: it asks the standby first, learns the sequence moved,
        # drops its copy and refuses the step (in both modes); nothing reaches the sequence.
        stale = Seq(s.sid, generation=old_generation)
        x = bf16_layers(c.spec, 1, c.rng)
        with pytest.raises(AttndError) as e:
            c._run(old, stale, x)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, e.value
        wait_for(lambda: _fenced(old, s.sid), "the old primary drops its copy", timeout_s=20)
        with pytest.raises(AttndError) as e:
            c._run(old, stale, x)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "failed over" in e.value.details
        # A step naming the old generation on the new primary is refused too.
        with pytest.raises(AttndError) as e:
            c._run(c.router.client_for(s.sid), stale, x)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "generation" in e.value.details
        # The sequence is as the worker knows it, and decodes as its twin does.
        assert c.router.client_for(s.sid).describe_sequence(s.sid).length == s.length
        c.step(s)
        m = scrape(c.mports[c.address_of[primary]])
        assert re.search(r"^attnd_fenced_total [1-9]", m, re.M), m[-2000:]
        m = scrape(c.mports[c.address_of[standby]])
        assert re.search(r"^attnd_promotions_total 1$", m, re.M)
        old.close()
    finally:
        c.close()


def _standby_copy(client, sid, generation, length) -> bool:
    try:
        d = client.describe_sequence(sid)
    except AttndError:
        return False
    return d.standby and d.generation == generation and d.length == length


def _describe_code(client, sid):
    """The status DescribeSequence answers for ``sid`` (OK when it is there)."""
    try:
        client.describe_sequence(sid)
    except AttndError as e:
        return e.code
    return grpc.StatusCode.OK


def _fenced(client, sid) -> bool:
    return _describe_code(client, sid) == grpc.StatusCode.FAILED_PRECONDITION


def test_standby_copies_refuse_ordinary_steps_and_bad_promotions(tmp_path):
    c = Cluster(tmp_path, "sync")
    try:
        s = c.open("copy")
        c.step(s, T=37)
        primary, standby, _ = ranked(c.names, s.sid)
        with AttndClient(c.address_of[standby], timeout=10.0) as there:
            d = there.describe_sequence(s.sid)
            assert (d.standby, d.generation, d.length) == (True, 1, 37)
            x = bf16_layers(c.spec, 1, c.rng)
            with pytest.raises(AttndError) as e:
                c._run(there, s, x)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "standby copy" in e.value.details
            with pytest.raises(AttndError) as e:  # forks of a copy: no
                there.open_sequence("copy-child", s.sid, 10)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            for generation, length, code in ((2, 37, grpc.StatusCode.FAILED_PRECONDITION),
                                             (0, 37, grpc.StatusCode.INVALID_ARGUMENT),
                                             (2**62, 37, grpc.StatusCode.INVALID_ARGUMENT),
                                             (1, -1, grpc.StatusCode.OUT_OF_RANGE)):
                with pytest.raises(AttndError) as e:
                    there.promote_sequence(s.sid, generation, length)
                assert e.value.code == code, (generation, length, e.value)
            # A replication step sent again after its reply was lost names where it starts:
            # refused when the copy took it already (37 tokens, not 30).
            with pytest.raises(AttndError) as e:
                there.begin_step([(s.sid, 7)], write_only=True, generations=[1], starts=[30])
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "holds 37 tokens, the step starts at 30" in e.value.details, e.value
            with pytest.raises(AttndError) as e:
                there.begin_step([(s.sid, 7)], write_only=True, starts=[-1])
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            # Replication closes a copy only at its generation; never a primary.
            with pytest.raises(AttndError) as e:
                there.close_sequence(s.sid, standby_generation=2)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert there.describe_sequence(s.sid) == d, "refusals change nothing"
            with pytest.raises(AttndError) as e:  # the primary is no standby
                c.router.client_for(s.sid).promote_sequence(s.sid, 1, 37)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(AttndError) as e:
                c.router.client_for(s.sid).close_sequence(s.sid, standby_generation=1)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "a primary at generation 1" in e.value.details, e.value
        # Closing the primary closes its copy.
        c.router.client_for(s.sid).close_sequence(s.sid)
        with AttndClient(c.address_of[standby], timeout=10.0) as there:
            wait_for(lambda: _gone(there, s.sid), "the copy closes with its primary")
        assert primary != standby
    finally:
        c.close()


def _gone(client, sid) -> bool:
    return _describe_code(client, sid) == grpc.StatusCode.NOT_FOUND


def test_peers_resolve_after_start_and_a_malformed_peer_is_refused(tmp_path):
    """A headless Service resolves only to ready pods: a replica starts before its peers resolve
    (and finds them later); a peer that is no HOST:PORT or dns:NAME:PORT stops the start."""
    proc, target, _ = start(["--standby-peers=dns:not-yet.invalid:50051"], kv_pages=64,
                            threads=1, log=tmp_path / "unresolved.log")
    try:
        with AttndClient(target, timeout=10.0) as c:
            r = c.info().replication
            assert (r.mode, r.peers, r.max_lag_steps) == ("async", (), 4)
            info = c.open_sequence("alone")  # served, unprotected
            assert (info.generation, info.standby_replica) == (1, "")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    r = subprocess.run([str(ATTND_BIN), "--model=tiny", "--kv-pages=64", "--grpc-port=0",
                        "--metrics-port=0", "--standby-peers=no-port-here"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert "neither HOST:PORT nor dns:NAME:PORT" in r.stdout + r.stderr


def test_a_step_asks_a_standby_that_stopped_answering_once_not_per_sequence(tmp_path):
    """Issue 53: before a step, Confirm asks the standby of each sequence it has not heard from
    for the ack timeout whether the sequence failed over there; a standby that does not answer
    is marked down, and the step's other sequences on it are not asked again (each ask waits
    the ack timeout: six sequences on a stopped standby held the step for six of them)."""
    c = Cluster(tmp_path, "async")
    try:
        first, second = ranked(c.names, "ask-0")[:2]
        sids = [f"ask-{i}" for i in range(400)
                if ranked(c.names, f"ask-{i}")[:2] == [first, second]][:6]
        assert len(sids) == 6
        seqs = [c.open(sid) for sid in sids]
        for s in seqs:
            c.step(s, T=2)
        primary, _, standby_proc = _pause_caught_up_standby(c, seqs[0])
        assert primary == first
        try:
            time.sleep(0.8)  # past the 500 ms ack timeout: every sequence's standby is asked
            with AttndClient(c.address_of[first], timeout=30.0) as client:
                t0 = time.monotonic()
                step = client.begin_step([(s.sid, 1) for s in seqs],
                                         generations=[s.generation for s in seqs])
                waited = time.monotonic() - t0
                client.abort_step(step.step_id)
            # One ask's timeout (500 ms), not six (3 s); the margin is the machine's.
            assert waited < 1.8, f"BeginStep took {waited:.2f} s"
        finally:
            standby_proc.send_signal(signal.SIGCONT)
    finally:
        c.close()


def test_a_standby_is_promoted_only_once_its_primarys_lease_ran_out_or_it_is_gone(tmp_path):
    # docs/replication.md#leases: while the lease it granted runs, a standby refuses to promote
    # its copy (UNAVAILABLE, saying for how long), so a primary that is only paused or cut off
    # never commits beside its promoted copy; the router waits it out. A primary whose address
    # refuses connections is gone: its lease ends with it (test_a_killed_primary_...). Bad
    # lease_ms values are refused with nothing changed.
    c = Cluster(tmp_path, "sync")
    try:
        s = c.open("leased")
        c.step(s, T=20)
        primary, standby, _ = ranked(c.names, s.sid)
        with AttndClient(c.address_of[standby], timeout=10.0) as there:
            wait_for(lambda: _standby_copy(there, s.sid, 1, s.length), "the copy caught up")
            d = there.describe_sequence(s.sid)
            for req, method, what in (
                    (pb.DescribeSequenceRequest(sequence_id=s.sid, lease_ms=-1),
                     "DescribeSequence", "lease_ms: -1 outside [0, 600000] ms"),
                    (pb.DescribeSequenceRequest(sequence_id=s.sid, lease_ms=600001),
                     "DescribeSequence", "lease_ms: 600001 outside"),
                    (pb.OpenSequenceRequest(sequence_id="plain", lease_ms=1000),
                     "OpenSequence", "lease_ms: only with standby_generation"),
                    (pb.BeginStepRequest(batch=[pb.BatchEntry(sequence_id=s.sid, q_len=1)],
                                         lease_ms=1000),
                     "BeginStep", "lease_ms: only on write-only (replication) steps")):
                with pytest.raises(AttndError) as e:
                    there._unary(method, req, lambda r: r)
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value)
                assert what in e.value.details, e.value.details
            assert there.describe_sequence(s.sid) == d, "refusals change nothing"
            proc = c.procs[c.address_of[primary]]
            proc.send_signal(signal.SIGSTOP)  # paused: it may still serve when it wakes
            paused = time.monotonic()
            try:
                with pytest.raises(AttndError) as e:
                    there.promote_sequence(s.sid, 1, s.length)
                assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
                left = int(re.search(r"runs (\d+) ms more", e.value.details).group(1))
                assert 0 < left <= 2000, e.value.details
                assert there.describe_sequence(s.sid).standby, "refused: still a copy"
                c.fail_over(s, failed=primary)  # the router waits for the lease to run out
                waited = time.monotonic() - paused
                assert waited <= 2.0 + 1.0, waited
                assert c.router.pick(s.sid) == standby and s.generation == 2
            finally:
                proc.send_signal(signal.SIGCONT)
        c.step(s)
    finally:
        c.close()


def test_a_sequence_closed_and_reopened_during_a_round_is_not_reported_replicated(tmp_path):
    """Issue 53: a sequence closed and opened again while its standby's round was in flight kept
    its old copy's state, so the new sequence's first commit was "replicated" (its length under
    the old copy's) while nothing of it had been sent. Each opening is now a copy of its own."""
    c = Cluster(tmp_path, "async", extra=["--replication-ack-timeout-ms=3000",
                                          "--replication-lease-ms=6000"])
    try:
        s = c.open("again")
        c.step(s, T=37)
        primary, standby, _ = ranked(c.names, s.sid)
        with AttndClient(c.address_of[standby], timeout=10.0) as sb:
            wait_for(lambda: _standby_copy(sb, s.sid, 1, s.length), "the copy caught up")
        proc = c.procs[c.address_of[standby]]
        proc.send_signal(signal.SIGSTOP)  # the next round waits on it (up to the ack timeout)
        try:
            client = c.router.client_for(s.sid)
            c.step(s)  # its rows go out in a round that cannot end yet
            time.sleep(0.3)
            client.close_sequence(s.sid)
            client.open_sequence(s.sid)
            fresh = Seq(s.sid)
            x = bf16_layers(c.spec, 3, c.rng)
            (protection,) = _protection(client, [(fresh, 3)], x)
            assert protection != "replicated", "nothing of the new sequence was sent"
        finally:
            proc.send_signal(signal.SIGCONT)
        # Once the standby answers: the old copy closed, the new one made and caught up.
        with AttndClient(c.address_of[standby], timeout=10.0) as sb:
            wait_for(lambda: _standby_copy(sb, s.sid, 1, 3), "the new sequence's copy", 30)
        (protection,) = _protection(client, [(fresh, 1)], bf16_layers(c.spec, 1, c.rng))
        assert protection in ("shipping", "replicated"), protection
    finally:
        c.close()


def test_failover_promotes_the_longest_copy_not_the_first_named(tmp_path):
    """Issue 53: the router promoted the replica it was told held the standby (or the first in
    hash order) without comparing copies, so a stale copy left on a former standby won over the
    caught-up one. It now asks each candidate and promotes the longest copy at the generation."""
    c = Cluster(tmp_path, "sync")
    try:
        s = c.open("longest-0")
        for _ in range(3):
            c.step(s, T=3)
        primary, standby, former = ranked(c.names, s.sid)
        with AttndClient(c.address_of[standby], timeout=10.0) as sb:
            wait_for(lambda: _standby_copy(sb, s.sid, 1, s.length), "the copy caught up")
        with AttndClient(c.address_of[former], timeout=10.0) as old:  # a copy left behind, empty
            old._unary("OpenSequence", pb.OpenSequenceRequest(sequence_id=s.sid,
                                                              standby_generation=1), lambda r: r)
        c.kill(primary)
        _, info = c.router.failover(s.sid, generation=1, length=s.length, standby=former)
        assert info.length == s.length and info.generation == 2, info
        with AttndClient(c.address_of[standby], timeout=10.0) as sb:
            assert sb.describe_sequence(s.sid) == info, "promoted on the replica with every row"
    finally:
        c.close()
