"""The replicated cluster the standby-replica tests share (docs/replication.md): three real attnd
on loopback, each with --standby-peers naming all three, a twin that never fails, attnd.Router,
and the probes the tests read standby copies and commits with (test_failover.py,
test_fencing.py, test_partition.py)."""

from __future__ import annotations

import os
import re
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import grpc
import ml_dtypes
import numpy as np

from attnd import AttndClient, AttndError, LayerInputs, Router, name_replicas, ranked

from attnd_process import free_port, start
from attnd_testlib import bf16_layers, scrape, wait_for

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

        def start_replicas():
            for port in self.ports:
                proc, target, mport = start(flags, port=port, kv_pages=kv_pages, threads=1,
                                            log=tmp_path / f"{mode}-{port}.log")
                self.procs[target], self.mports[target] = proc, mport

        self.bring_up(start_replicas, tmp_path, mode)

    def bring_up(self, start_replicas, tmp_path, mode: str) -> None:
        """start_replicas() (filling self.procs and self.mports), then join; on any failure kills
        what started: the caller's finally never runs for a constructor that raised."""
        self.procs, self.mports, self.twin_proc = {}, {}, None
        try:
            start_replicas()
            self.join(tmp_path, mode)
        except BaseException:
            self._kill_all()
            raise

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
        self._kill_all()

    def _kill_all(self) -> None:
        for p in [*self.procs.values(), self.twin_proc]:
            if p is not None and p.poll() is None:
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


def _gone(client, sid) -> bool:
    return _describe_code(client, sid) == grpc.StatusCode.NOT_FOUND


def pause(proc) -> None:
    """SIGSTOPs proc and returns once every one of its threads is stopped: the signal is
    delivered asynchronously, and a thread still running can answer one more message (a sync
    commit came back "replicated" after the SIGSTOP was sent, once in a loaded CI run)."""
    proc.send_signal(signal.SIGSTOP)

    def stopped() -> bool:
        try:
            task = Path(f"/proc/{proc.pid}/task")
            states = [(task / t / "stat").read_text().rsplit(")", 1)[1].split()[0]
                      for t in os.listdir(task)]
        except OSError:  # a thread ended meanwhile: look again
            return False
        return all(st in ("T", "t") for st in states)

    wait_for(stopped, "the process stopped")


def _pause_caught_up_standby(c: Cluster, s: Seq):
    """Waits until s's standby has every commit, then stops it (SIGSTOP: it acknowledges
    nothing from here on; the caller sends SIGCONT). Returns (primary, its metrics port, the
    standby's process)."""
    primary, standby = ranked(c.names, s.sid)[:2]
    mport = c.mports[c.address_of[primary]]
    wait_for(lambda: _lag(mport) == 0, "the standby catches up")
    standby_proc = c.procs[c.address_of[standby]]
    pause(standby_proc)
    return primary, mport, standby_proc
