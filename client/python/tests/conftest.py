"""Makes the checkout's client/python importable, and its compiled API descriptor present, before
the tests import attnd — unless ATTND_TEST_INSTALLED=1: then the tests run against the attnd
package installed in this interpreter (scripts/test_python_package.sh)."""

import os
import subprocess
import sys

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.environ.get("ATTND_TEST_INSTALLED") != "1":
    if PYTHON_DIR not in sys.path:
        sys.path.insert(0, PYTHON_DIR)
    # Idempotent and quiet: recompiles attnd/v1/attention.binpb only when missing or stale, with
    # the interpreter running the tests (the one that has grpc_tools), not whatever python3 is
    # first on the PATH (a fresh machine's has none).
    subprocess.run([os.path.join(PYTHON_DIR, "generate_stubs.sh")], check=True,
                   env={**os.environ, "PYTHON": sys.executable})


# ---- servers: one fixture per flag set -----------------------------------------------------------
# Every attnd the tests start goes through attnd_process.start; tests whose flags are their own
# (peers, model files) call it through the ``attnd_server`` factory or a module fixture.

import itertools  # noqa: E402  (after the sys.path set-up above)
import signal  # noqa: E402
import tempfile  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from attnd_process import ATTND_BIN, start, stop, tail  # noqa: E402
from attnd_testlib import Harness, free_port, socket_path  # noqa: E402


@pytest.fixture(scope="session")
def server():
    """The session attnd (tiny model, 512 pages, shared memory on its Unix socket
    ``socket_path(port)``); yields its target. At the end: SIGTERM, which must exit 0."""
    from attnd import AttndClient

    if not ATTND_BIN.is_file():
        pytest.fail(f"attnd binary not found at {ATTND_BIN}: build it (scripts/test.sh) or set "
                    "ATTND_BIN")
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="attnd-pytest-", suffix=".log")[1])
    # ATTND_TEST_DATA_PLANE=ucx (scripts/test.sh's second pass over the layer-call tests): the
    # server offers the UCX data plane, and every client's layer tensors travel through it, the
    # outputs pushed (ctest's ucx.* pass over the C++ tests has them pulled, the default).
    plane = (["--data-plane=ucx", "--data-plane-push=true"]
             if os.environ.get("ATTND_TEST_DATA_PLANE") == "ucx" else [])
    proc, target, _ = start(["--metrics-port=0", "--shm", f"--shm-socket={socket_path(port)}",
                             *plane], kv_pages=512, threads=2, port=port, log=log)
    try:
        with AttndClient(target, timeout=2.0) as probe:
            probe.info()
        yield target
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                pytest.fail(f"attnd did not exit within 30 s of SIGTERM\n{tail(log)}")
    assert proc.returncode == 0, f"attnd exited with {proc.returncode} after SIGTERM\n{tail(log)}"
    log.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def client(server):
    """A client of the session server (60 s deadline per call)."""
    from attnd import AttndClient

    with AttndClient(server, timeout=60.0) as c:
        if os.environ.get("ATTND_TEST_DATA_PLANE") == "ucx":
            assert c.connect_data_plane().startswith("ucx-"), "the pass over the data plane"
        yield c


@pytest.fixture(scope="session")
def info(client):
    """The session server's ServerInfo, checked to be what the float64 reference models."""
    info = client.info()
    spec = info.model
    # The reference models these modes only.
    assert spec.selection == "token", spec
    assert spec.prefill == "sparse", spec
    assert set(spec.layers) <= {"full", "shared", "dense"}, spec
    assert spec.sliding_window == 0 and spec.soft_cap == 0, spec
    assert info.cache_datatype in ("BF16", "FP32"), info
    return info


_ids = itertools.count()


@pytest.fixture
def harness(client, info, request):
    """A per-test harness: fresh sequence ids, a seeded rng, the reference; closes its sequences."""
    h = Harness(client, info, seed=zlib.crc32(request.node.name.encode()), tag=f"t{next(_ids)}")
    yield h
    h.close_all()


@pytest.fixture
def attnd_server():
    """A factory: ``attnd_server(extra, **start_kwargs)`` starts an attnd as attnd_process.start
    does and returns (target, metrics port); each one stops at the test's end (a clean exit)."""
    procs = []

    def make(extra, **kwargs):
        proc, target, mport = start(extra, **kwargs)
        procs.append(proc)
        return target, mport

    yield make
    for proc in procs:
        if proc.poll() is None:
            stop(proc)


@pytest.fixture
def two_servers(attnd_server):
    """Two plain attnds (128 pages each); their targets."""
    return attnd_server([], kv_pages=128)[0], attnd_server([], kv_pages=128)[0]


@pytest.fixture
def fp8_pair(attnd_server):
    """Two attnds with an fp8 key cache (128 pages each); their targets."""
    return (attnd_server(["--cache-dtype=fp8"], kv_pages=128)[0],
            attnd_server(["--cache-dtype=fp8"], kv_pages=128)[0])
