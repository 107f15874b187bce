"""Operations against a real attnd: health (liveness and readiness), reflection, Prometheus metrics
checked by promtool, and a clean SIGTERM shutdown with a step still open."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request

import grpc
import numpy as np
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from test_deploy import dashboard_query

from attnd import AttndClient, AttndError, LayerInputs
from attnd.v1 import attention_pb2 as pb
from attnd.v1 import attention_pb2_grpc as pb_grpc

from attnd_process import ATTND_BIN, ROOT, running, start, stop
from attnd_process import free_port as _free_port


def _start(extra: list[str]) -> tuple[subprocess.Popen, str, int]:
    return start(extra, kv_pages=256, threads=2)


@pytest.fixture(scope="module")
def ops_server():
    proc, target, mport = _start([])
    yield target, mport
    stop(proc)


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
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = stub.ServerReflectionInfo(iter([request]))
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert "attnd.v1.Attention" in names
    assert "grpc.health.v1.Health" in names


def test_reflection_describes_health_so_a_generic_client_can_call_it(ops_server):
    # What grpcurl does: ask reflection for the file declaring the service, build the request
    # from that descriptor alone, call the method by name.
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    target, _ = ops_server
    with grpc.insecure_channel(target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="grpc.health.v1.Health")
        (reply,) = list(stub.ServerReflectionInfo(iter([request])))
        assert reply.HasField("file_descriptor_response"), reply
        pool = descriptor_pool.DescriptorPool()
        for raw in reply.file_descriptor_response.file_descriptor_proto:
            pool.Add(descriptor_pb2.FileDescriptorProto.FromString(raw))
        service = pool.FindServiceByName("grpc.health.v1.Health")
        check = service.methods_by_name["Check"]
        assert "Watch" in service.methods_by_name
        req_cls = message_factory.GetMessageClass(check.input_type)
        resp_cls = message_factory.GetMessageClass(check.output_type)
        call = ch.unary_unary("/grpc.health.v1.Health/Check",
                              request_serializer=req_cls.SerializeToString,
                              response_deserializer=resp_cls.FromString)
        resp = call(req_cls(service="attnd.v1.Attention"), timeout=5)
        status = check.output_type.enum_types_by_name["ServingStatus"]
        assert status.values_by_number[resp.status].name == "SERVING"


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


def _series(text: str):
    """(name, labels, value) of every sample line."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, rest = head.partition("{")
        labels = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv) if rest else {}
        yield name, {k: v.strip('"') for k, v in labels.items()}, float(value)


def _sum(text: str, name: str, **want) -> float:
    return sum(v for n, labels, v in _series(text)
               if n == name and all(labels.get(k) == w for k, w in want.items()))


def _layers(spec, t, rng, dtype=np.float32):
    out = []
    for kind in spec.layers:
        x = dict(q_latent=rng.standard_normal((t, spec.num_heads, spec.kv_lora_rank), dtype),
                 q_rope=rng.standard_normal((t, spec.num_heads, spec.qk_rope_head_dim), dtype),
                 kv_latent=rng.standard_normal((t, spec.kv_lora_rank), dtype),
                 k_rope=rng.standard_normal((t, spec.qk_rope_head_dim), dtype))
        if kind == "full":
            x.update(index_q=rng.standard_normal((t, spec.index_n_heads, spec.index_head_dim),
                                                 dtype),
                     index_k=rng.standard_normal((t, spec.index_head_dim), dtype),
                     index_w=rng.standard_normal((t, spec.index_n_heads), dtype))
        out.append(x)
    return out


def test_metrics_count_tokens_once_aborts_and_rejections_by_reason():
    """Each counter moves on its own cause: tokens once per committed step by phase, aborts by
    reason (abort, cancel, error, expiry), rejections by reason (cache_full, max_context), errors
    by method and code; build info, process metrics and the reply's server time are there."""
    proc, target, mport = _start(["--step-idle-timeout-ms=200"])
    rng = np.random.default_rng(8)
    try:
        with AttndClient(target, timeout=30) as c:
            info = c.info()
            spec = info.model
            t0 = _scrape(mport)
            c.open_sequence("m-a")
            step = c.begin_step([("m-a", 5)])
            for i, x in enumerate(_layers(spec, 5, rng)):
                c.attend_layer(step.step_id, LayerInputs(i, **x))
            st = c.begin_step([("m-a", 1)])           # abort
            c.abort_step(st.step_id)
            s = c.stream()                             # cancel
            s.begin([("m-a", 1)])
            s.cancel()
            st = c.begin_step([("m-a", 2)])           # error: a bad shape
            x = _layers(spec, 1, rng)[0]
            with pytest.raises(AttndError):
                c.attend_layer(st.step_id, LayerInputs(0, **x))
            c.begin_step([("m-a", 1)])                # expiry (idle 200 ms)
            time.sleep(1.0)
            with pytest.raises(AttndError) as e:       # max_context
                c.begin_step([("m-a", spec.max_context)])
            assert e.value.code == grpc.StatusCode.OUT_OF_RANGE
            pages = info.devices[0].pages_total * spec.page_size
            ids = [f"m-big-{i}" for i in range(pages // spec.max_context + 2)]
            for sid in ids:
                c.open_sequence(sid)
            with pytest.raises(AttndError) as e:       # cache full
                c.begin_step([(sid, spec.max_context) for sid in ids])
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
            # The reply says how long the server spent on the layer.
            with grpc.insecure_channel(target) as ch:
                stub = pb_grpc.AttentionStub(ch)
                step = c.begin_step([("m-a", 1)])
                xs = _layers(spec, 1, rng)
                for i, x in enumerate(xs):
                    msg = pb.AttendLayerRequest(step_id=step.step_id, inputs=_wire(i, x))
                    out = stub.AttendLayer(msg, timeout=30).output
                    assert 0 < out.server_seconds < 30, out.server_seconds
            t1 = _scrape(mport)
        d = lambda name, **kw: _sum(t1, name, **kw) - _sum(t0, name, **kw)  # noqa: E731
        assert d("attnd_tokens_total", phase="prefill") == 5, "tokens count once per step"
        assert d("attnd_tokens_total", phase="decode") == 1
        for reason in ("abort", "cancel", "error", "expiry"):
            assert d("attnd_steps_aborted_total", reason=reason) >= 1, reason
        assert d("attnd_rejections_total", reason="max_context") == 1
        assert d("attnd_rejections_total", reason="cache_full") == 1
        assert d("attnd_rpc_errors_total", method="BeginStep", code="OUT_OF_RANGE") == 1
        assert d("attnd_rpc_errors_total", method="AttendLayer", code="INVALID_ARGUMENT") == 1
        assert d("attnd_payload_bytes_total", direction="received") > 0
        assert d("attnd_step_seconds_count", phase="prefill") == 1
        assert d("attnd_layer_seconds_count", phase="decode", kind="full") >= 1
        version = info.version.split()[1]
        assert _sum(t1, "attnd_build_info", version=version) == 1, info.version
        for name in ("process_resident_memory_bytes", "process_open_fds", "process_threads",
                     "process_start_time_seconds", "process_cpu_seconds_total"):
            assert _sum(t1, name) > 0, name
        assert 0 <= _sum(t1, "attnd_cache_utilization") <= 1
    finally:
        stop(proc)


def test_every_step_stream_is_counted_once_whatever_its_outcome():
    """A Step stream that ends OK, one cancelled and one refused each count once in
    attnd_rpc_requests_total and attnd_rpc_seconds (an OK stream used to be counted nowhere, so
    the error ratio's denominator missed the busiest method)."""
    rng = np.random.default_rng(52)
    # A server of its own: another test's stream that ends late would be counted in between.
    with running([]) as (_, target, mport), AttndClient(target, timeout=30) as c:
        spec = c.info().model
        c.open_sequence("counted")
        t0 = _scrape(mport)
        with c.stream() as s:  # OK: a whole step, then the client closes the stream
            s.begin([("counted", 2)])
            for i, x in enumerate(_layers(spec, 2, rng)):
                s.layer(LayerInputs(i, **x))
        s = c.stream()  # CANCELLED: the client goes away with a step open
        s.begin([("counted", 1)])
        s.cancel()
        with c.stream() as s:  # NOT_FOUND: a step of a sequence that is not there
            with pytest.raises(AttndError) as e:
                s.begin([("missing", 1)])
            assert e.value.code == grpc.StatusCode.NOT_FOUND, e.value
        deadline = time.monotonic() + 10
        t1 = _scrape(mport)  # the server counts a stream when it has finished it
        while (_sum(t1, "attnd_rpc_seconds_count", method="Step")
               - _sum(t0, "attnd_rpc_seconds_count", method="Step") < 3
               and time.monotonic() < deadline):
            time.sleep(0.05)
            t1 = _scrape(mport)
    d = lambda name, **kw: _sum(t1, name, **kw) - _sum(t0, name, **kw)  # noqa: E731
    assert d("attnd_rpc_requests_total", method="Step", code="OK") == 1
    assert d("attnd_rpc_requests_total", method="Step", code="CANCELLED") == 1
    assert d("attnd_rpc_requests_total", method="Step", code="NOT_FOUND") == 1
    assert d("attnd_rpc_seconds_count", method="Step") == 3
    assert d("attnd_rpc_errors_total", method="Step", code="NOT_FOUND") == 1
    assert d("attnd_rpc_errors_total", method="Step", code="OK") == 0


def test_logs_summarise_the_config_and_rate_limit_refused_steps():
    with running(["--log-level=info"]) as (proc, target, _):
        with AttndClient(target, timeout=30) as c:
            spec = c.info().model
            c.open_sequence("log-a")
            for _ in range(200):  # refused: beyond max_context
                with pytest.raises(AttndError):
                    c.begin_step([("log-a", spec.max_context + 1)])
            time.sleep(1.1)  # the next window: its first line reports what was dropped
            with pytest.raises(AttndError):
                c.begin_step([("log-a", spec.max_context + 1)])
    out = proc.stdout.read()
    assert "config: devices cpu:0, model tiny" in out, out[:2000]
    for said in ("cache BF16", "auth none", "keepalive 60000/20000 ms"):  # each said once
        assert sum(said in line for line in out.splitlines()) == 1, (said, out[:2000])
    refused = [line for line in out.splitlines() if "BeginStep: OUT_OF_RANGE" in line]
    assert 1 <= len(refused) <= 60, f"{len(refused)} lines for 200 refusals: not rate-limited"
    assert "max_context" in refused[0], refused[0]
    assert "similar lines dropped" in refused[-1], refused[-1]


def test_json_logs_are_one_object_per_line_lifecycle_lines_included(tmp_path, monkeypatch):
    log = tmp_path / "attnd.log"
    # gRPC core's own lines too (at debug it prints its experiments at start): JSON, not text.
    monkeypatch.setenv("GRPC_VERBOSITY", "debug")
    with running(["--log-format=json", "--log-level=info"], log=log) as (proc, target, _):
        with AttndClient(target, timeout=30) as c:
            c.open_sequence("json-a")
            with pytest.raises(AttndError):
                c.begin_step([("json-a", c.info().model.max_context + 1)])
    lines = [json.loads(line) for line in log.read_text().splitlines()]  # each one parses
    assert all({"ts", "level", "msg"} <= line.keys() for line in lines), lines
    msgs = [line["msg"] for line in lines]
    lifecycle = [line["msg"] for line in lines if "file" not in line]  # Say()'s lines
    assert lifecycle[0].startswith("serving attnd.v1 on 127.0.0.1:"), msgs
    assert any(m.startswith("config: devices cpu:0, model tiny") for m in msgs), msgs
    assert any(m.startswith("stopped (") for m in msgs), msgs
    refused = [line for line in lines if "BeginStep: OUT_OF_RANGE" in line["msg"]]
    assert refused and refused[0]["level"] in ("INFO", "WARNING"), lines
    assert re.fullmatch(r"[a-z_]+\.cc:\d+", refused[0]["file"]), refused[0]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", refused[0]["ts"])
    core = [line for line in lines if "gRPC EXPERIMENT" in line["msg"]]
    assert core and core[0]["level"] == "DEBUG", lines[:5]
    assert re.fullmatch(r"[a-z_]+\.cc:\d+", core[0]["file"]), core[0]


def _mem_available():
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def test_the_cache_sized_as_a_fraction_of_memory():
    """--kv-cache-fraction: the cache is that share of the host's available memory (the pod's,
    within a cgroup limit), said on the startup line and in ServerInfo."""
    want = 0.01 * _mem_available()
    with running(["--kv-cache-fraction=0.01"], kv_pages=None) as (proc, target, _):
        line = proc.stdout.readline()
        assert "0.01 of" in line and "host memory available" in line, line
        with AttndClient(target, timeout=30) as c:
            d = c.info().devices[0]
        got = (d.pages_total + 1) * d.bytes_per_page  # + the reserved page 0
        assert 0.8 * want < got < 1.2 * want, (got, want)
    r = subprocess.run([str(ATTND_BIN), "--kv-cache-fraction=1.5"], capture_output=True, text=True)
    assert r.returncode == 2 and "--kv-cache-fraction" in r.stderr, r.stderr


def _wire(layer, x):
    msg = pb.LayerInputs(layer=layer)
    for name, v in x.items():
        t = getattr(msg, name)
        t.datatype = "FP32"
        t.shape.extend(v.shape)
        t.data = np.ascontiguousarray(v, np.float32).tobytes()
    return msg


def _rule_files(tmp_path):
    """The PrometheusRule's groups as a plain rules file for promtool."""
    doc = yaml.safe_load((ROOT / "deploy" / "prometheus" / "attnd-rules.yaml").read_text())
    assert doc["kind"] == "PrometheusRule"
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}))
    return path, doc


def test_alert_rules_and_dashboard_check_and_name_only_exported_metrics(ops_server, tmp_path):
    target, mport = ops_server
    with AttndClient(target, timeout=30) as c:  # one committed step: every histogram has series
        spec = c.info().model
        c.open_sequence("rules-1")
        step = c.begin_step([("rules-1", 1)])
        for i, x in enumerate(_layers(spec, 1, np.random.default_rng(1))):
            c.attend_layer(step.step_id, LayerInputs(i, **x))
        c.close_sequence("rules-1")
    path, doc = _rule_files(tmp_path)
    r = subprocess.run([shutil.which("promtool"), "check", "rules", str(path)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    exported = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
                for n, _, _ in _series(_scrape(mport))}
    exported |= {"attnd_rejections_total", "attnd_rpc_errors_total"}  # appear on first error
    exprs = [rule["expr"] for g in doc["spec"]["groups"] for rule in g["rules"]]
    dash = json.loads((ROOT / "deploy" / "grafana" / "attnd-dashboard.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    for expr in exprs:
        for name in re.findall(r"\b((?:attnd|process)_[a-z_]+)", expr):
            base = name.removesuffix("_bucket")
            assert base in exported, f"{name} in {expr!r} is not a metric attnd exports"


def test_a_real_prometheus_scrapes_attnd_under_load(ops_server, tmp_path):
    target, mport = ops_server
    prom = shutil.which("prometheus")
    assert prom, "prometheus (Debian package) is required; scripts/install-deps.sh installs it"
    pport = _free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "attnd",
                            "static_configs": [{"targets": [f"127.0.0.1:{mport}"]}]}]}))
    p = subprocess.Popen([prom, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                          f"--web.listen-address=127.0.0.1:{pport}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rng = np.random.default_rng(9)
    try:
        with AttndClient(target, timeout=30) as c:
            spec = c.info().model
            c.open_sequence("prom-load")
            t0 = time.monotonic()
            deadline, value = t0 + 60, 0.0
            # Over several scrapes (the rates below need calls between two of them), until
            # Prometheus has seen decode tokens.
            while time.monotonic() < deadline and (value < 20 or time.monotonic() < t0 + 4):
                step = c.begin_step([("prom-load", 1)])
                for i, x in enumerate(_layers(spec, 1, rng)):
                    c.attend_layer(step.step_id, LayerInputs(i, **x))
                with pytest.raises(AttndError):  # one failed call per step: an error ratio
                    c.describe_sequence("prom-no-such-sequence")
                # Decode tokens between two scrapes (increase needs two samples in the window),
                # so the rates below have seen the load, however late Prometheus began scraping.
                q = urllib.parse.quote('sum(increase(attnd_tokens_total{phase="decode"}[5m]))')
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{pport}/api/v1/query?query={q}",
                                                timeout=5) as r:
                        res = json.loads(r.read())["data"]["result"]
                        value = float(res[0]["value"][1]) if res else 0.0
                except OSError:
                    pass  # still starting
                time.sleep(0.05)
            c.close_sequence("prom-load")
        assert value >= 20, f"Prometheus saw {value} decode tokens"
        # The dashboard's error-ratio panel, as Prometheus computes it: every DescribeSequence
        # failed, no BeginStep did.
        dash = json.loads((ROOT / "deploy" / "grafana" / "attnd-dashboard.json").read_text())
        expr = dashboard_query(next(p for p in dash["panels"]
                                    if "error ratio" in p["title"])["targets"][0]["expr"])
        ratios, deadline, want = {}, time.monotonic() + 20, {"DescribeSequence", "BeginStep"}
        # (Until both are numbers: a rate needs two scrapes of the window; on a loaded machine
        # Prometheus may have scraped the load only once when it ended.)
        while time.monotonic() < deadline and not (
                want <= ratios.keys() and all(math.isfinite(ratios[m]) for m in want)):
            q = urllib.parse.quote(expr)
            with urllib.request.urlopen(f"http://127.0.0.1:{pport}/api/v1/query?query={q}",
                                        timeout=5) as r:
                ratios = {x["metric"]["method"]: float(x["value"][1])
                          for x in json.loads(r.read())["data"]["result"]}
            time.sleep(0.5)
        assert ratios.get("DescribeSequence") == 1.0 and ratios.get("BeginStep") == 0.0, ratios
        with urllib.request.urlopen(f"http://127.0.0.1:{pport}/api/v1/targets", timeout=5) as r:
            targets = json.loads(r.read())["data"]["activeTargets"]
        assert targets and targets[0]["health"] == "up", targets
    finally:
        p.terminate()
        p.wait(timeout=30)


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
                H, f32 = spec.num_heads, np.float32
                ins = dict(q_latent=rng.standard_normal((t, H, spec.kv_lora_rank), f32),
                           q_rope=rng.standard_normal((t, H, spec.qk_rope_head_dim), f32),
                           kv_latent=rng.standard_normal((t, spec.kv_lora_rank), np.float32),
                           k_rope=rng.standard_normal((t, spec.qk_rope_head_dim), np.float32))
                if kind == "full":
                    ins.update(index_q=rng.standard_normal(
                                   (t, spec.index_n_heads, spec.index_head_dim), np.float32),
                               index_k=rng.standard_normal((t, spec.index_head_dim), np.float32),
                               index_w=rng.standard_normal((t, spec.index_n_heads), np.float32))
                s.layer(LayerInputs(layer, **ins))
        text = _scrape(mport)
        assert _sample(text, 'attnd_steps_total{outcome="committed"}') == before + 1
        assert _sum(text, "attnd_layer_seconds_count", transport="stream",
                    phase="prefill") >= len(spec.layers)
        assert _sample(text, 'attnd_cache_pages{device="cpu:0",state="used"}') >= 1
        assert _sample(text, "attnd_sequences") >= 1
        c.close_sequence("ops-m")
    promtool = shutil.which("promtool")
    assert promtool, ("promtool (Debian package prometheus) is required; "
                      "scripts/install-deps.sh installs it")
    path = tmp_path / "metrics.txt"
    path.write_text(text)
    with open(path) as f:
        r = subprocess.run([promtool, "check", "metrics"], stdin=f, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_sigterm_with_an_open_step_drains_and_exits_zero():
    # Without peers the drain still waits up to --drain-timeout-ms for open steps (listener open,
    # NOT_SERVING); this one never sends a layer, so the wait ends at the timeout.
    proc, target, _ = _start(["--shutdown-grace-ms=300", "--drain-timeout-ms=1000"])
    with AttndClient(target) as c:
        c.open_sequence("ops-drain")
        s = c.stream()
        s.begin([("ops-drain", 3)])
        t0 = time.monotonic()
        stop(proc)
        assert time.monotonic() - t0 < 10
        s.cancel()
    out = proc.stdout.read()
    assert "draining" in out and "stopped" in out, out
    assert "1 step(s) still open after --drain-timeout-ms=1000 are aborted at exit" in out, out


ATTNCTL = ATTND_BIN.parent.parent / "client" / "attnctl"


def _ctl(*args, env=None, check=None):
    e = dict(os.environ, **(env or {}))
    r = subprocess.run([str(ATTNCTL), *args], capture_output=True, text=True, env=e, timeout=120)
    if check is not None:
        assert r.returncode == check, (args, r.returncode, r.stdout, r.stderr)
    return r


def test_attnctl_is_a_conventional_cli(ops_server):
    target, _ = ops_server
    r = _ctl("--help", check=0)
    assert "Usage: attnctl" in r.stdout and not r.stderr
    version = _ctl("--version", check=0).stdout.strip()
    server = subprocess.run([str(ATTND_BIN), "--version"], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert version.startswith("attnctl ") and version[8:] == server[6:], (version, server)
    for cmd in ("info", "health", "list", "describe", "close", "drain", "demo", "bench", "handoff",
                "soak"):
        r = _ctl(cmd, "--help", check=0)
        assert f"attnctl {cmd}" in r.stdout, r.stdout  # per-command help, nothing run
    for bad in (["info", "--bogus=1"], ["info", "stray"], ["demo", "--sequences=0"], [],
                ["handoff", "--sequence=x"], ["--output=yaml", "info"], ["describe"], ["close"]):
        r = _ctl(*bad, check=2)
        assert r.stderr and not r.stdout, bad
    env = {"ATTND_TARGET": target}
    assert "SERVING" in _ctl("health", env=env, check=0).stdout
    assert _ctl("health", "--service=", env=env, check=0).stdout == "(server): SERVING\n"
    # A service name longer than one protobuf length byte (it was sent mis-encoded): unknown.
    r = _ctl("health", "--service=" + "x" * 150, env=env, check=1)
    assert "NOT_FOUND" in r.stderr, (r.stdout, r.stderr)
    info = json.loads(_ctl("info", "--output=json", env=env, check=0).stdout)
    assert info["model"]["name"] == "tiny" and info["version"].startswith("attnd ")
    listed = json.loads(_ctl("list", "--output", "json", env=env, check=0).stdout)
    assert isinstance(listed.get("sequences", []), list)


def test_attnctl_gives_up_on_a_hung_server_after_its_timeout():
    """A stopped server (SIGSTOP: the port accepts, nothing answers): --timeout bounds each call,
    health defaults to 5 s (a probe must fail inside the kubelet's timeout), 0 waits."""
    proc, target, _ = _start([])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        for args, limit in ((["info", "--timeout=1"], 1), (["health"], 5),
                            (["list", "--timeout", "0.5"], 0.5)):
            t0 = time.monotonic()
            r = _ctl(*args, f"--target={target}", check=1)
            took = time.monotonic() - t0
            assert "DEADLINE_EXCEEDED" in r.stderr, (args, r.stderr)
            assert limit <= took < limit + 3, (args, took)
        waiting = subprocess.Popen([str(ATTNCTL), "info", "--timeout=0", f"--target={target}"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(2)
        assert waiting.poll() is None, "--timeout=0 gave up"
        os.kill(proc.pid, signal.SIGCONT)
        out, err = waiting.communicate(timeout=30)
        assert waiting.returncode == 0 and "tiny" in out, (out, err)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        stop(proc)


def test_a_failed_demo_leaves_no_sequence_behind():
    # Room for the demo's four sequences but not its forks: it fails half-way (after the
    # prefill), and closes what it opened.
    with running(["--max-sequences=4"]) as (proc, target, _):
        r = _ctl("demo", f"--target={target}", "--sequences=4", "--prompt=300")
        assert r.returncode == 1 and "--max-sequences" in r.stderr, (r.stdout, r.stderr)
        assert "prefill 1/1" in r.stdout, r.stdout  # it did get half-way
        with AttndClient(target) as c:
            assert c.list_sequences() == [], "the failed demo left sequences open"


def test_ctrl_c_on_the_demo_closes_what_it_opened():
    """The first Ctrl-C stops attnctl demo before its next step; it closes its sequences and
    exits 130. (It used to die at once and leave them open, holding the server's pages.)"""
    with running(["--kv-pages=4096"]) as (proc, target, _):  # the tiny model's 8192 context
        demo = subprocess.Popen([str(ATTNCTL), "demo", f"--target={target}", "--sequences=2",
                                 "--prompt=64", "--chunk=16", "--decode=8000", "--check=none"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            with AttndClient(target) as c:
                deadline = time.monotonic() + 30
                while len(c.list_sequences()) < 4 and time.monotonic() < deadline:
                    time.sleep(0.05)  # its two sequences and their two forks: decoding now
                assert len(c.list_sequences()) == 4, (demo.poll(), c.list_sequences())
                demo.send_signal(signal.SIGINT)
                out, err = demo.communicate(timeout=30)
                assert demo.returncode == 130, (out, err)
                assert "interrupted" in err, err
                assert c.list_sequences() == [], "Ctrl-C left the demo's sequences open"
        finally:
            if demo.poll() is None:
                demo.kill()


def test_demo_and_bench_refuse_what_cannot_fit_before_building_anything():
    # Beyond max_context or the free pages: refused at once, naming both numbers, nothing opened.
    with running(["--kv-pages=100"]) as (proc, target, _):
        with AttndClient(target) as c:
            info = c.info()
        free = sum(d.pages_free for d in info.devices)
        cases = [
            (["demo", "--prompt=100000"], f"over the model's max_context {info.model.max_context}"),
            (["demo", "--sequences=3", "--prompt=2000"], f"the server has {free} free"),
            (["bench", "--batch=64", "--context=4096"], f"the server has {free} free"),
            (["bench", "--context=9000"], "over the model's max_context"),
        ]
        for args, want in cases:
            t0 = time.monotonic()
            r = _ctl(*args, f"--target={target}")
            assert r.returncode == 1 and want in r.stderr, (args, r.stdout, r.stderr)
            assert time.monotonic() - t0 < 5, args
            with AttndClient(target) as c:
                assert c.list_sequences() == [], args


def test_demo_checks_all_a_sample_or_nothing_against_float64(ops_server):
    target, _ = ops_server
    runs = {}
    for mode in ("all", "sample", "none"):
        r = _ctl("demo", f"--target={target}", "--sequences=3", "--prompt=200", "--decode=8",
                 f"--check={mode}", check=0)
        assert "prefill 1/1" in r.stdout and "decode 8/8" in r.stdout, r.stdout  # progress
        runs[mode] = r.stdout
    assert "of 5 sequence(s) against float64" in runs["all"] and "PASS" in runs["all"]
    assert "of 3 sequence(s) against float64" in runs["sample"] and "PASS" in runs["sample"]
    assert "reference check: skipped (--check=none)" in runs["none"]
    r = _ctl("demo", f"--target={target}", "--check=some", check=2)  # a usage error
    assert "--check" in r.stderr and not r.stdout
