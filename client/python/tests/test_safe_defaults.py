"""Safe defaults (issue 28): a taken port is a startup error, admin calls without authentication
only from this host, drains only to configured peers, and the flag and device refusals."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import List, Optional

import grpc
import numpy as np
import pytest

from attnd import AttndClient, AttndError, LayerInputs
from attnd.v1 import attention_pb2 as pb

from attnd_process import ATTND_BIN, running, start, stop
from attnd_testlib import bf16_layers


def _run(args: List[str]) -> subprocess.CompletedProcess:
    """attnd with `args` that is expected to refuse to start (exit within 60 s)."""
    cmd = [str(ATTND_BIN), "--model=tiny", "--grpc-address=127.0.0.1", "--grpc-port=0",
           "--metrics-port=0", "--threads=1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _port(target: str) -> int:
    return int(target.rsplit(":", 1)[1])


def _host_address() -> Optional[str]:
    """A non-loopback IPv4 address of this host (no packet is sent), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 9))
            address = s.getsockname()[0]
    except OSError:
        address = ""
    if address and not address.startswith("127.") and address != "0.0.0.0":
        return address
    try:
        for address in socket.gethostbyname_ex(socket.gethostname())[2]:
            if not address.startswith("127."):
                return address
    except OSError:
        pass
    return None


def test_a_taken_port_is_a_startup_error_naming_it():
    with running([]) as (proc, target, _):
        port = _port(target)
        r = _run([f"--grpc-port={port}"])
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert f"port {port} in use" in r.stderr and "--reuse-grpc-port" in r.stderr, r.stderr
        assert "serving attnd.v1" not in r.stdout
        with AttndClient(target, timeout=30) as c:  # the first server still serves, alone
            c.open_sequence("mine")
            for _ in range(6):
                assert c.describe_sequence("mine").length == 0


def test_reuse_grpc_port_shares_a_port_on_purpose():
    first, target, _ = start(["--reuse-grpc-port"])
    try:
        second, _, _ = start(["--reuse-grpc-port"], port=_port(target))
        try:
            with AttndClient(target, timeout=30) as c:
                assert c.info().model.name == "tiny"
        finally:
            stop(second)
    finally:
        stop(first)


def test_without_auth_admin_calls_are_served_only_on_this_host():
    host = _host_address()
    if host is None:
        pytest.skip("this host has no non-loopback IPv4 address to call from")
    proc, target, _ = start(["--grpc-address=0.0.0.0"])  # later flags win
    port = _port(target)
    try:
        with AttndClient(f"{host}:{port}", timeout=30) as remote:
            spec = remote.info().model
            remote.open_sequence("remote-seq")  # ordinary calls are served to everyone
            with pytest.raises(AttndError) as e:
                remote.drain([])
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED, e.value
            assert "only on loopback or the local socket" in str(e.value), e.value
            rng = np.random.default_rng(28)
            width = spec.num_heads * 16
            weights = [rng.standard_normal((width, spec.kv_lora_rank), dtype=np.float32)
                       for _ in range(spec.num_layers)]
            with pytest.raises(AttndError) as e:
                remote.upload_absorption(weights, 8, 8)
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED, e.value
        with AttndClient(f"127.0.0.1:{port}", timeout=30) as local:
            assert local.describe_sequence("remote-seq").length == 0
        assert proc.poll() is None
    finally:
        stop(proc)


def _denied(call, why: str) -> None:
    with pytest.raises(AttndError) as e:
        call()
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED, e.value
    assert why in str(e.value), e.value


def test_without_auth_nothing_reads_or_moves_keys_from_another_address(tmp_path):
    """Without --auth the keys of every sequence are one tenant's: an export (a handoff's source),
    an import open (its target) and a standby copy are admin calls, served on loopback and to the
    bearer of --admin-token-file only (how replicas drain to each other across hosts)."""
    host = _host_address()
    if host is None:
        pytest.skip("this host has no non-loopback IPv4 address to call from")
    token = tmp_path / "admin-token"
    token.write_text("an-admin-token-of-some-length\n")
    with running(["--grpc-address=0.0.0.0", f"--admin-token-file={token}"]) as (_, target, _m):
        port = _port(target)
        with AttndClient(f"127.0.0.1:{port}", timeout=30) as local:
            spec = local.info().model
            local.open_sequence("secret")
            step = local.begin_step([("secret", 2)])
            for i, x in enumerate(bf16_layers(spec, 2, np.random.default_rng(52))):
                local.attend_layer(step.step_id, LayerInputs(i, **x))
        why = "admin calls are served only on loopback or the local socket"
        standby = pb.OpenSequenceRequest(sequence_id="copy", standby_generation=1)
        for bearer in (None, "a-wrong-token-of-some-length"):
            with AttndClient(f"{host}:{port}", timeout=30, token=bearer) as remote:
                assert remote.describe_sequence("secret").length == 2  # ordinary calls: served
                _denied(lambda: list(remote.export_sequence("secret")), why)
                _denied(lambda: remote.open_sequence("copy", import_length=2, import_generation=1),
                        why)
                with pytest.raises(grpc.RpcError) as e:  # a standby copy, as a replicator opens
                    remote._stub.OpenSequence(standby, timeout=30, metadata=remote._metadata)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value
                assert why in e.value.details(), e.value
                assert [s.sequence_id for s in remote.list_sequences()] == ["secret"]
        with AttndClient(f"{host}:{port}", timeout=30,
                         token="an-admin-token-of-some-length") as admin:
            chunks = list(admin.export_sequence("secret"))
            assert chunks and all(c.length == 2 and c.tokens == 2 for c in chunks), chunks
            admin.open_sequence("copy", import_length=2, import_generation=1)
        with AttndClient(f"{host}:{port}", timeout=30) as remote:  # nor fill another's target
            _denied(lambda: remote.begin_step([("copy", 2)], write_only=True),
                    "only the admin writes a handoff's target")
    r = _run(["--auth=token", f"--auth-tokens={token}", f"--admin-token-file={token}"])
    assert r.returncode != 0 and "--admin-token-file is for --auth=none" in r.stderr, r.stderr


def test_a_drain_goes_only_to_configured_peers():
    peer, peer_target, _ = start([])
    proc, target, _ = start([f"--drain-peers={peer_target}"])
    try:
        with AttndClient(target, timeout=30) as c:
            c.open_sequence("stays")
            for bad in (["attacker.example:50051"], [peer_target, "10.0.0.9:1"]):
                with pytest.raises(AttndError) as e:
                    c.drain(bad)
                assert e.value.code == grpc.StatusCode.PERMISSION_DENIED, e.value
                assert "is not among --drain-peers" in str(e.value), e.value
            assert c.describe_sequence("stays").length == 0  # nothing moved, still serving
            assert c.health() == "SERVING"
            c.drain([peer_target])  # a configured peer: the drain runs
        assert proc.wait(timeout=60) == 0
        with AttndClient(peer_target, timeout=30) as p:
            assert p.describe_sequence("stays").length == 0
    finally:
        for p in (proc, peer):
            if p.poll() is None:
                stop(p)


def _mem_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def test_flag_and_device_refusals_say_what():
    r = _run(["--auth-tokens=/nonexistent/tokens.txt"])
    assert r.returncode == 2 and "--auth-tokens needs --auth=token" in r.stderr, r.stderr
    r = _run(["--devices=cpu:0,cpu:0", "--kv-pages=64"])
    assert r.returncode == 1 and "'cpu:0' is named twice" in r.stderr, r.stderr
    # deepseek-v3.2's pages are large: twice this host's memory is a few ten thousand pages.
    r = _run(["--model=deepseek-v3.2", f"--kv-cache-bytes={2 * _mem_total_bytes()}"])
    assert r.returncode == 1, (r.stdout, r.stderr)
    m = re.search(r"the cache needs ([0-9.]+) GiB of host memory .* but ([0-9.]+) GiB are "
                  r"available", r.stderr)
    assert m and float(m.group(1)) > float(m.group(2)), r.stderr


@pytest.mark.parametrize("spelling,reported", [("BF16", "BF16"), ("FP8_E4M3", "FP8_E4M3"),
                                               ("fp32", "FP32")])
def test_the_cache_dtype_takes_the_apis_spelling(spelling, reported):
    with running([f"--cache-dtype={spelling}"]) as (proc, target, _):
        with AttndClient(target, timeout=30) as c:
            assert c.info().cache_datatype == reported


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_metrics_follow_the_grpc_address_and_the_start_line_names_both():
    if not _ipv6_loopback():
        pytest.skip("this host has no IPv6 loopback")
    cmd = [str(ATTND_BIN), "--model=tiny", "--kv-pages=64", "--threads=1", "--grpc-address=::1",
           "--grpc-port=0", "--metrics-port=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"serving attnd\.v1 on \[::1\]:(\d+) .* metrics on \[::1\]:(\d+)/metrics",
                      line)
        assert m, line  # loopback stays loopback, IPv6 stays IPv6
        with urllib.request.urlopen(f"http://[::1]:{m.group(2)}/metrics", timeout=10) as r:
            assert b"attnd_build_info" in r.read()
        with pytest.raises(OSError):  # not on IPv4's loopback, nor any other interface
            urllib.request.urlopen(f"http://127.0.0.1:{m.group(2)}/metrics", timeout=10)
        with AttndClient(f"[::1]:{m.group(1)}", timeout=30) as c:
            assert c.info().model.name == "tiny"
    finally:
        stop(proc)
    # An IPv6 address this host does not have: refused at start, naming the address.
    r = _run(["--grpc-address=fd00::1"])
    assert r.returncode == 1 and "fd00::1" in r.stderr, r.stderr


def _scrape_total(mport: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def test_a_sequence_lease_runs_out_without_steps_and_attnctl_describes_and_closes():
    attnctl = ATTND_BIN.parent.parent / "client" / "attnctl"
    with running(["--sequence-idle-timeout-s=1"]) as (proc, target, mport):
        with AttndClient(target, timeout=30) as c:
            c.open_sequence("idle")
            c.open_sequence("kept")
            for _ in range(6):  # ~3 s: every step renews kept's lease (begun and aborted)
                c.abort_step(c.begin_step([("kept", 1)]).step_id)
                time.sleep(0.5)
            with pytest.raises(AttndError) as e:
                c.describe_sequence("idle")
            assert e.value.code == grpc.StatusCode.NOT_FOUND, e.value
            assert c.describe_sequence("kept").length == 0
        assert _scrape_total(mport, "attnd_sequences_expired_total") == 1
        ctl = lambda *a: subprocess.run([str(attnctl), f"--target={target}", *a],  # noqa: E731
                                        capture_output=True, text=True, timeout=60)
        r = ctl("describe", "kept")
        assert r.returncode == 0 and r.stdout.startswith("kept\t0 tokens"), (r.stdout, r.stderr)
        r = ctl("close", "kept")
        assert r.returncode == 0 and "closed kept" in r.stdout, (r.stdout, r.stderr)
        r = ctl("describe", "kept")
        assert r.returncode == 1 and "NOT_FOUND" in r.stderr, (r.stdout, r.stderr)


def test_a_drain_without_peers_lets_open_steps_finish_with_the_listener_open():
    proc, target, _ = start(["--drain-timeout-ms=20000"])
    try:
        with AttndClient(target, timeout=10) as c:
            spec = c.info().model
            c.open_sequence("finishing")
            c.open_sequence("holder")  # its open step keeps the drain waiting until the checks
            layers = bf16_layers(spec, 3, np.random.default_rng(7))
            step = c.begin_step([("finishing", 3)])
            held = c.begin_step([("holder", 1)])
            out0 = c.attend_layer(step.step_id, LayerInputs(0, **layers[0]))
            proc.send_signal(signal.SIGTERM)
            for _ in range(400):  # the open channel answers NOT_SERVING (never UNAVAILABLE)
                if c.health() == "NOT_SERVING":
                    break
                time.sleep(0.005)
            assert c.health() == "NOT_SERVING" and c.health("") == "SERVING"
            with pytest.raises(AttndError) as e:  # new work is refused meanwhile
                c.begin_step([("finishing", 1)])
            assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
            outs = [out0] + [c.attend_layer(step.step_id, LayerInputs(i, **x))
                             for i, x in enumerate(layers) if i > 0]
            assert all(o.shape == (3, spec.num_heads, spec.kv_lora_rank) for o in outs)
            assert all(np.isfinite(o.astype(np.float32)).all() for o in outs)
            assert c.describe_sequence("finishing").length == 3  # the step committed
            one = bf16_layers(spec, 1, np.random.default_rng(8))
            for i, x in enumerate(one):  # the last open step ends: the drain is over
                c.attend_layer(held.step_id, LayerInputs(i, **x))
        assert proc.wait(timeout=60) == 0
        assert "2 sequence(s) are dropped at exit" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            stop(proc)


_FROZEN_WORKER = """
import os, signal, sys
import numpy as np
from attnd import AttndClient, LayerInputs
from attnd_testlib import bf16_layers
c = AttndClient(sys.argv[1], timeout=30.0)
c.open_sequence("frozen")
s = c.stream()
s.begin([("frozen", 2)])
s.layer(LayerInputs(0, **bf16_layers(c.info().model, 2, np.random.default_rng(1))[0]))
print("in step", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # a worker that hangs (or whose node vanished): no FIN
"""


def _frozen_worker_step_after(extra, seconds: float) -> bool:
    """Whether a frozen worker's open step is still open `seconds` after it froze."""
    proc, target, _ = start(["--step-idle-timeout-ms=60000", *extra], kv_pages=32)
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")]))
    worker = subprocess.Popen([sys.executable, "-c", _FROZEN_WORKER, target], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "in step"
        with AttndClient(target) as c:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if not c.describe_sequence("frozen").in_step:
                    return False
                time.sleep(0.05)
            return True
    finally:
        worker.kill()
        worker.wait()
        stop(proc)


def test_keepalive_finds_a_frozen_worker_and_frees_its_step():
    # Server pings every 300 ms, 300 ms to answer: the frozen worker's connection is closed and
    # its step aborted within about a second, not after --step-idle-timeout-ms (60 s here).
    assert not _frozen_worker_step_after(
        ["--keepalive-time-ms=300", "--keepalive-timeout-ms=300"], 5.0)
    # Without keepalive the step stays open (its sequence in a step nobody drives).
    assert _frozen_worker_step_after(["--keepalive-time-ms=0"], 3.0)


def test_max_connection_age_reconnects_clients_and_an_open_step_stream_outlives_it():
    with running(["--max-connection-age-ms=300"], kv_pages=32) as (proc, target, _):
        from attnd.v1 import attention_pb2 as pb
        from attnd.v1 import attention_pb2_grpc as pb_grpc
        states = []
        with grpc.insecure_channel(target) as ch:
            ch.subscribe(lambda st: states.append(st.name), try_to_connect=True)
            stub = pb_grpc.AttentionStub(ch)
            stub.ServerInfo(pb.ServerInfoRequest(), timeout=5)
            time.sleep(1.5)
            stub.ServerInfo(pb.ServerInfoRequest(), timeout=5)
        assert "IDLE" in states[states.index("READY"):], states  # closed by age, then reconnected
        # A Step stream open across the age is not cut (the grace is unbounded by default).
        rng = np.random.default_rng(4)
        with AttndClient(target, timeout=30.0) as c:
            spec = c.info().model
            c.open_sequence("aged")
            with c.stream() as s:
                s.begin([("aged", 3)])
                x = bf16_layers(spec, 3, rng)
                s.layer(LayerInputs(0, **x[0]))
                time.sleep(1.0)  # past the age, mid-step
                for i, layer in enumerate(x[1:], start=1):
                    s.layer(LayerInputs(i, **layer))
            assert c.describe_sequence("aged").length == 3


def test_the_python_client_takes_its_target_and_token_from_the_environment(monkeypatch, tmp_path):
    # As attnctl: $ATTND_TARGET when no target is given, $ATTND_TOKEN when no token is.
    tokens = tmp_path / "tokens"
    tokens.write_text("env-token-0123456789 team-a\n")
    with running(["--auth=token", f"--auth-tokens={tokens}"], kv_pages=32) as (proc, target, _):
        monkeypatch.setenv("ATTND_TARGET", target)
        monkeypatch.setenv("ATTND_TOKEN", "env-token-0123456789")
        with AttndClient() as c:
            assert c.info().tenant == "team-a"
        monkeypatch.delenv("ATTND_TOKEN")
        with AttndClient() as c, pytest.raises(AttndError) as e:
            c.info()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
