"""Trust through the Python client against a real attnd (docs/trust.md): mTLS with certificates made
here by openssl, metrics over HTTPS, reflection switched off, bearer tokens with health left open
for probes, and tenant isolation."""

from __future__ import annotations

import ssl
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from attnd import AttndClient, AttndError

from attnd_process import start, stop

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for localhost and a client certificate for tenant team-py."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", *EC, "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", str(d / "ca.key"),
             "-out", str(d / "ca.pem"), "-addext", "basicConstraints=critical,CA:TRUE")
    for name, cn, san in (("server", "attnd", "DNS:localhost,IP:127.0.0.1"),
                          ("client", "team-py", "")):
        ext = d / f"{name}.ext"
        ext.write_text("basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n" +
                       (f"subjectAltName={san}\n" if san else ""))
        _openssl("req", "-new", *EC, "-subj", f"/CN={cn}", "-keyout", str(d / f"{name}.key"),
                 "-out", str(d / f"{name}.csr"))
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"), "-CAkey",
                 str(d / "ca.key"), "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out",
                 str(d / f"{name}.pem"))
    return d


def _start(extra: list[str]):
    return start(extra, kv_pages=64, threads=1)


@pytest.fixture(scope="module")
def mtls_server(pki):
    proc, target, mport = _start([
        f"--tls-cert={pki / 'server.pem'}", f"--tls-key={pki / 'server.key'}",
        f"--tls-client-ca={pki / 'ca.pem'}", "--auth=mtls", "--metrics-tls",
        "--grpc-reflection=false"])
    yield target, mport
    stop(proc)


def _tls_client(pki: Path, target: str, with_cert: bool) -> AttndClient:
    kwargs = {}
    if with_cert:
        kwargs = dict(private_key=(pki / "client.key").read_bytes(),
                      certificate_chain=(pki / "client.pem").read_bytes())
    return AttndClient(target, timeout=10.0, root_certificates=(pki / "ca.pem").read_bytes(),
                       server_name="localhost", **kwargs)


def test_mtls_names_the_tenant_and_refuses_clients_without_a_certificate(pki, mtls_server):
    target, _ = mtls_server
    with _tls_client(pki, target, with_cert=True) as c:
        info = c.info()
        assert (info.tenant, info.auth, info.admin) == ("team-py", "mtls", False)
        c.open_sequence("py-seq")
        assert [s.sequence_id for s in c.list_sequences()] == ["py-seq"]
        with pytest.raises(AttndError) as e:
            c.list_sequences(all_tenants=True)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        c.close_sequence("py-seq")
    with _tls_client(pki, target, with_cert=False) as c:
        with pytest.raises(AttndError) as e:
            c.info()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    with AttndClient(target, timeout=10.0) as plain:
        with pytest.raises(AttndError) as e:
            plain.info()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_metrics_over_https_with_the_servers_certificate(pki, mtls_server):
    _, mport = mtls_server
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    with urllib.request.urlopen(f"https://localhost:{mport}/metrics", context=ctx, timeout=10) as r:
        assert r.status == 200
        assert "attnd_" in r.read().decode()
    with pytest.raises(Exception):  # noqa: B017 (plain HTTP on the TLS port gets no metrics: any failure)
        urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read()


def test_reflection_can_be_switched_off(pki, mtls_server):
    target, _ = mtls_server
    creds = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes(),
                                         (pki / "client.key").read_bytes(),
                                         (pki / "client.pem").read_bytes())
    with grpc.secure_channel(target, creds,
                             options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                list_services="")]), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    tokens = d / "tokens.txt"
    tokens.write_text("py-token-a-0123456789 a\npy-token-b-0123456789 b\n")
    proc, target, _ = _start(["--auth=token", f"--auth-tokens={tokens}"])
    yield target
    stop(proc)


def test_tokens_name_tenants_and_health_stays_open(token_server):
    target = token_server
    with grpc.insecure_channel(target) as ch:  # probes carry no credentials
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="attnd.v1.Attention"), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    with AttndClient(target, timeout=10.0) as anonymous:
        with pytest.raises(AttndError) as e:
            anonymous.info()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    with AttndClient(target, timeout=10.0, token="py-token-a-0123456789") as a, \
            AttndClient(target, timeout=10.0, token="py-token-b-0123456789") as b:
        assert a.info().tenant == "a"
        a.open_sequence("mine")
        with pytest.raises(AttndError) as e:
            b.describe_sequence("mine")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        with a.stream() as s:  # streams carry the token too
            assert s.begin([("mine", 1)]).num_tokens == 1
            s.abort()
        a.close_sequence("mine")
