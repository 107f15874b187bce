"""Operations against a real attnd: health (liveness and readiness), reflection, Prometheus metrics
checked by promtool, and a clean SIGTERM shutdown with a step still open."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from attnd import AttndClient

ROOT = Path(__file__).resolve().parents[3]
ATTND_BIN = Path(os.environ.get("ATTND_BIN", ROOT / "build" / "service" / "attnd"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(extra: list[str]) -> tuple[subprocess.Popen, str, int]:
    port, mport = _free_port(), _free_port()
    proc = subprocess.Popen(
        [str(ATTND_BIN), f"--grpc-port={port}", "--grpc-address=127.0.0.1", "--model=tiny",
         "--kv-pages=256", "--threads=2", f"--metrics-port={mport}", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    assert "serving attnd.v1" in line, line
    return proc, f"127.0.0.1:{port}", mport


@pytest.fixture(scope="module")
def ops_server():
    proc, target, mport = _start([])
    yield target, mport
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_health_serves_liveness_and_readiness(ops_server):
    target, _ = ops_server
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "attnd.v1.Attention"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, name
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_api(ops_server):
    target, _ = ops_server
    with grpc.insecure_channel(target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert "attnd.v1.Attention" in names
    assert "grpc.health.v1.Health" in names


def _scrape(mport: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def _sample(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in metrics:\n{text}")


def test_metrics_pass_promtool_and_count_the_work(ops_server, tmp_path):
    target, mport = ops_server
    rng = np.random.default_rng(3)
    with AttndClient(target) as c:
        spec = c.info().model
        c.open_sequence("ops-m")
        before = _sample(_scrape(mport), 'attnd_steps_total{outcome="committed"}')
        with c.stream() as s:
            s.begin([("ops-m", 5)])
            for layer, kind in enumerate(spec.layers):
                t = 5
                ins = dict(q_latent=rng.standard_normal((t, spec.num_heads, spec.kv_lora_rank), np.float32),
                           q_rope=rng.standard_normal((t, spec.num_heads, spec.qk_rope_head_dim), np.float32),
                           kv_latent=rng.standard_normal((t, spec.kv_lora_rank), np.float32),
                           k_rope=rng.standard_normal((t, spec.qk_rope_head_dim), np.float32))
                if kind == "full":
                    ins.update(index_q=rng.standard_normal((t, spec.index_n_heads, spec.index_head_dim), np.float32),
                               index_k=rng.standard_normal((t, spec.index_head_dim), np.float32),
                               index_w=rng.standard_normal((t, spec.index_n_heads), np.float32))
                s.layer(layer, **ins)
        text = _scrape(mport)
        assert _sample(text, 'attnd_steps_total{outcome="committed"}') == before + 1
        assert _sample(text, 'attnd_layer_seconds_count{transport="stream"}') >= len(spec.layers)
        assert _sample(text, 'attnd_cache_pages{device="cpu:0",state="used"}') >= 1
        assert _sample(text, "attnd_sequences") >= 1
        c.close_sequence("ops-m")
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is required; scripts/install-deps.sh installs it"
    path = tmp_path / "metrics.txt"
    path.write_text(text)
    with open(path) as f:
        r = subprocess.run([promtool, "check", "metrics"], stdin=f, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_sigterm_with_an_open_step_drains_and_exits_zero():
    proc, target, _ = _start(["--shutdown-grace-ms=300"])
    with AttndClient(target) as c:
        c.open_sequence("ops-drain")
        s = c.stream()
        s.begin([("ops-drain", 3)])
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 10
        s.cancel()
    out = proc.stdout.read()
    assert "draining" in out and "stopped" in out, out
