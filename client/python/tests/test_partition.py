"""Standby replicas under a real network partition (docs/replication.md#leases and #fencing). A
sequence's primary runs in a network namespace of its own, joined to its two peers and to the
worker by a veth pair; taking the namespace's end of the link down cuts it off while it keeps
running: its peers and the worker meet silence (their calls run into their deadlines), it meets an
unreachable network. test_failover.py pauses a primary with SIGSTOP instead, which stops the
process too.

At the cut, a stale worker beside the cut-off primary (in its namespace) steps the sequence there,
step after step: the primary commits them only while the lease its standby granted holds (3/4 of
--replication-lease-ms after its standby last answered), then refuses (UNAVAILABLE, no lease): its
last commit comes at most the lease after the cut, in `async` and in `sync` mode. The worker fails
the sequence over to its standby, which is promoted once the primary's lease ran out there, and
goes on there. When the link comes back, what the cut-off primary took never reaches the sequence:
its copy of those commits is refused by the new primary, it drops the sequence, and refuses every
later call for it; the sequence is the worker's, bit for bit.

Needs root and `ip netns` (iproute2); skipped where either is missing."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from netns import Netns, netns_available
from replication_cluster import Cluster, Seq, _fenced, _standby_copy, replication_flags

from attnd import AttndClient, AttndError, ranked

from attnd_process import free_port, start
from attnd_testlib import bf16_layers, wait_for

WORKER = Path(__file__).with_name("partition_worker.py")
LEASE_S = 2.0  # --replication-lease-ms's default


pytestmark = pytest.mark.skipif(not netns_available(),
                                reason="needs root and network namespaces (ip netns)")


class PartitionedCluster(Cluster):
    """test_failover's cluster with replica 0 in ``net`` (listening on every address there, so
    its peers reach it at net.inside and a worker beside it at 127.0.0.1), the other two on
    net.outside."""

    def __init__(self, tmp_path, mode: str, net: Netns) -> None:
        self.ports = [free_port() for _ in range(3)]
        self.addresses = [f"{net.inside}:{self.ports[0]}",
                          *(f"{net.outside}:{p}" for p in self.ports[1:])]
        # The replicas are on different addresses, not loopback: their standby copies are admin
        # calls only the bearer of --admin-token-file may make (docs/trust.md).
        token = tmp_path / f"{mode}-peer-token"
        token.write_text("a-peer-token-of-the-test-cluster\n")
        flags = [*replication_flags(self.addresses, mode), f"--admin-token-file={token}",
                 f"--drain-token-file={token}"]

        def start_replicas():
            for i, (port, address) in enumerate(zip(self.ports, self.addresses)):
                inside = i == 0
                bind = "0.0.0.0" if inside else net.outside
                proc, _, mport = start([*flags, f"--grpc-address={bind}"], port=port,
                                       kv_pages=400, threads=1,
                                       log=tmp_path / f"{mode}-{port}.log",
                                       wrap=net.run_inside() if inside else ())
                self.procs[address], self.mports[address] = proc, mport

        self.bring_up(start_replicas, tmp_path, mode)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_cut_off_primary_is_fenced_when_the_partition_heals(tmp_path, mode):
    net = Netns()
    c = None
    try:
        c = PartitionedCluster(tmp_path, mode, net)
        primary = c.name_of[c.addresses[0]]
        sid = next(f"part-{mode}-{i}" for i in itertools.count()
                   if ranked(c.names, f"part-{mode}-{i}")[0] == primary)
        standby = ranked(c.names, sid)[1]
        s = c.open(sid)
        c.step(s, T=37)
        c.step(s)
        with AttndClient(c.address_of[standby], timeout=10.0) as sb:
            wait_for(lambda: _standby_copy(sb, sid, 1, s.length), "the standby has every row")

        # The stale worker beside the primary steps it from the cut on: commits while the lease
        # holds, then refusals. The lease was last renewed by the step just before the cut.
        # Started (and connected) first, so its start-up on a loaded machine does not eat the lease.
        worker = subprocess.Popen([*net.run_inside(), sys.executable, str(WORKER),
                                   f"127.0.0.1:{c.ports[0]}", sid, str(s.generation), "5", "20"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert worker.stdout.readline().strip() == "ready", worker.stderr.read()[-3000:]
        c.step(s)
        cut_at = time.monotonic()
        net.cut()
        stdout, stderr = worker.communicate("go\n", timeout=120)
        assert worker.returncode == 0, stderr[-3000:]
        out = subprocess.CompletedProcess(worker.args, worker.returncode, stdout, stderr)
        steps = [line.split() for line in out.stdout.splitlines()]
        committed_at = [float(sent) for code, sent, _, _ in steps if code == "OK"]
        assert steps and steps[-1][0] == "UNAVAILABLE", out.stdout  # refused: no lease
        # Within the lease it served (unless a loaded machine took the lease's time already).
        last = max(committed_at, default=cut_at) - cut_at
        assert last <= LEASE_S, f"committed {last:.3f} s after the cut: {out.stdout}"
        print(f"{mode}: last commit {last:.3f} s after the cut (lease {LEASE_S} s)")

        with pytest.raises(AttndError) as e:  # the worker outside: silence, then its deadline
            c._run(c.router.client_for(sid), s, bf16_layers(c.spec, 1, c.rng))
        assert e.value.code in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.UNAVAILABLE), e.value
        stale_generation, committed = s.generation, s.length
        # The standby is promoted once the primary's lease ran out there (the router waits).
        c.fail_over(s, failed=primary)
        assert c.router.pick(sid) == standby and s.generation == stale_generation + 1
        c.step(s)
        c.step(s)

        net.heal()
        old = AttndClient(c.address_of[primary], timeout=10.0)
        try:
            # Its copy of that commit reaches the new primary, which refuses it: the old
            # primary drops the sequence, and refuses any later call for it.
            wait_for(lambda: _fenced(old, sid), "the old primary drops its copy", timeout_s=30)
            stale = Seq(sid, generation=stale_generation, length=committed + 1)
            with pytest.raises(AttndError) as e:
                c._run(old, stale, bf16_layers(c.spec, 1, c.rng))
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, e.value
            assert "failed over" in e.value.details
        finally:
            old.close()
        # Nothing the cut-off primary took reached the sequence: it is the worker's, and
        # decodes on as its twin does.
        assert c.router.client_for(sid).describe_sequence(sid).length == s.length
        c.step(s)
    finally:
        if c is not None:
            c.close()
        net.close()
