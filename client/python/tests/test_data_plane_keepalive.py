"""Keepalives (docs/data-plane.md): a client's process that dies leaves the server no endpoint of
its own to fail (a plane the client pulls from answers it only on the endpoints its messages
arrive by), so its plane used to stand idle ten minutes, its memory taken and counted against
--data-plane-max-planes: a fleet of workers restarted at once could find every plane taken. The
clients now offer keepalives in the handshake, and the server closes the plane of one silent for
three of them within a second (its housekeeping), no other client needing to connect."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from attnd import AttndClient
from attnd.data_plane import find_library
from attnd.v1 import attention_pb2 as pb

from attnd_process import start, stop
from attnd_testlib import Harness, expect, sample, scrape, wait_for

pytestmark = pytest.mark.skipif(find_library() is None, reason="libattnd_plane.so not built")

KEEPALIVE_MS = 400  # the live client's every 0.4 s: a stall of 1.2 s would close its plane

# A worker that connects a plane, says its name, and waits to be killed.
_WORKER = textwrap.dedent("""
    import sys
    from attnd import AttndClient
    c = AttndClient(sys.argv[1], timeout=30.0)
    print("plane", c.connect_data_plane(), flush=True)
    sys.stdin.read()
""")


def _planes(mport: int) -> float:
    return sample(scrape(mport), "attnd_data_plane_planes")


def test_the_plane_of_a_killed_worker_closes_within_seconds(tmp_path):
    proc, target, mport = start(["--data-plane=ucx", f"--data-plane-keepalive-ms={KEEPALIVE_MS}"],
                                log=tmp_path / "attnd.log")
    worker = None
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        worker = subprocess.Popen([sys.executable, "-c", _WORKER, target], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        line = worker.stdout.readline()
        assert line.startswith("plane "), worker.stderr.read()[-3000:]
        dead = line.split()[1]
        with AttndClient(target, timeout=30.0) as c:
            mine = c.connect_data_plane()  # a live client, idle as long as the dead one
            assert _planes(mport) == 2
            worker.send_signal(signal.SIGKILL)
            worker.wait(timeout=30)
            killed = time.monotonic()
            # No handshake meanwhile: the housekeeping closes the killed worker's plane in its
            # one-second round once three keepalives are missed (0.8-1.2 s after the kill); the
            # idle one stays.
            while _planes(mport) == 2 and time.monotonic() - killed < 10:
                time.sleep(0.05)
            closed_in = time.monotonic() - killed
            assert _planes(mport) == 1, "the killed worker's plane is still there"
            assert 2 * KEEPALIVE_MS / 1000 <= closed_in < 3 * KEEPALIVE_MS / 1000 + 3, closed_in
            assert sample(scrape(mport),
                          'attnd_data_plane_planes_closed_total{reason="silent"}') == 1
            # Logged once the plane's thread was joined (the metric fell before it).
            wait_for(lambda: "1 data plane(s) closed: their client is gone"
                     in (tmp_path / "attnd.log").read_text(), "the close is logged")
            expect(grpc.StatusCode.NOT_FOUND, c._call, c._stub.CloseDataPlane,
                   pb.CloseDataPlaneRequest(plane=dead))
            # The idle client's plane serves on: a step over it, checked against float64.
            h = Harness(c, c.info(), seed=3, tag="keepalive")
            sid = h.open("seq")
            h.step(c, [(sid, 4)])
            assert c.data_plane_name == mine
            h.close_all()
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        stop(proc)
