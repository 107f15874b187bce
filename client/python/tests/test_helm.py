"""The Helm chart (deploy/helm/attnd): rendered for several configurations, each object validated
strictly against the Kubernetes API's schemas, checked to wire together, its command line and
probes run against a real attnd (TLS and mTLS with certificates made here), and its refusals of
configurations that cannot work. Rendered by helm_render (a strict renderer of the chart's
template subset) and, where `helm` is installed, also by `helm lint` / `helm template`, which
must make the same objects."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from helm_render import Chart, Fail, TemplateError
from test_deploy import CUSTOM_KINDS, MANIFESTS, VERSIONS, check_flags

from attnd_process import ATTND_BIN, ROOT, start, stop

CHART = ROOT / "deploy" / "helm" / "attnd"
ATTNCTL = ATTND_BIN.parent.parent / "client" / "attnctl"
HELM = shutil.which("helm")

# Configurations a user would install: the defaults, mTLS with quotas and hard anti-affinity,
# bearer tokens, and a bare one (no PDB, no monitoring, spread over zones, extra flags).
VARIANTS = {
    "defaults": {},
    "mtls": {"tls": {"enabled": True, "clientAuth": True},
             "auth": {"mode": "mtls", "adminTenant": "ops"},
             "quotas": {"pages": 200000}, "antiAffinity": "hard",
             "extraArgs": ["--grpc-reflection=false"]},
    "token": {"tls": {"enabled": True}, "auth": {"mode": "token", "adminTenant": "ops"},
              "replicas": 3, "image": {"tag": "0.3.0-rc1"},
              "replication": {"enabled": True, "mode": "sync"}},
    "bare": {"podDisruptionBudget": {"enabled": False}, "serviceMonitor": {"enabled": False},
             "dashboard": {"enabled": False}, "antiAffinity": "none",
             "topologySpread": {"enabled": True}, "cache": {"dtype": "fp8"},
             "sequenceIdleTimeoutSeconds": 600, "extraArgs": ["--log-level=warning"],
             "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
             "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                              "effect": "NoSchedule"}]},
}


def _render(values):
    return Chart(CHART).render(values)


def _one(docs, kind):
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, (kind, [d["kind"] for d in docs])
    return found[0]


def _container(docs):
    return _one(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]


def _args(docs):
    return dict(a.split("=", 1) for a in _container(docs)["args"])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_strictly_against_the_kubernetes_schemas(variant, version):
    docs = _render(VARIANTS[variant])
    kinds = sorted(d["kind"] for d in docs)
    if variant == "bare":
        assert kinds == ["Service", "StatefulSet"]
    else:
        assert kinds == ["ConfigMap", "PodDisruptionBudget", "Service", "ServiceMonitor",
                         "StatefulSet"]
    for doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_objects_select_and_reach_each_other(variant):
    docs, values = _render(VARIANTS[variant]), Chart(CHART).defaults
    svc, sts, c = _one(docs, "Service"), _one(docs, "StatefulSet"), _container(docs)
    pod = sts["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    selectors = [svc["spec"]["selector"], sts["spec"]["selector"]["matchLabels"]]
    if variant != "bare":
        selectors.append(_one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"])
        mon = _one(docs, "ServiceMonitor")
        assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert mon["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = pod["spec"]
    for term in spec.get("affinity", {}).get("podAntiAffinity", {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution", []):
        selectors.append(term["labelSelector"]["matchLabels"])
    for term in spec.get("topologySpreadConstraints", []):
        selectors.append(term["labelSelector"]["matchLabels"])
    for selector in selectors:
        assert selector and selector.items() <= pod_labels.items()
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["replicas"] == VARIANTS[variant].get("replicas", values["replicas"])
    container_ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == container_ports.keys()
    args = _args(docs)
    assert args["--grpc-port"] == str(container_ports["grpc"])
    assert args["--metrics-port"] == str(container_ports["metrics"])
    assert args["--drain-peers"] == f"dns:{svc['metadata']['name']}:{container_ports['grpc']}"
    drain_s = (int(args["--drain-timeout-ms"]) + int(args["--shutdown-grace-ms"])) / 1000
    assert spec["terminationGracePeriodSeconds"] > drain_s
    # Probes: liveness on the server's health, readiness on the service the drain turns off.
    for probe, service in (("startupProbe", ""), ("livenessProbe", ""),
                           ("readinessProbe", "attnd.v1.Attention")):
        if "grpc" in c[probe]:
            assert variant in ("defaults", "bare")
            assert c[probe]["grpc"] == {"port": container_ports["grpc"], "service": service}
        else:
            cmd = c[probe]["exec"]["command"]
            assert cmd[:3] == ["attnctl", "health", f"--service={service}"], cmd
            assert f"--target=127.0.0.1:{container_ports['grpc']}" in cmd
    assert c["readinessProbe"]["failureThreshold"] >= 2
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["securityContext"]["runAsNonRoot"]
    # Every mounted path the flags name is in a mounted volume.
    mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
    for flag, path in args.items():
        if path.startswith("/etc/attnd/"):
            assert str(Path(path).parent) in mounts, (flag, path)
    check_flags(c["args"])


def test_the_image_is_the_release_unless_a_tag_is_given():
    version = re.search(r"project\(attnd VERSION ([0-9.]+)",
                        (ROOT / "CMakeLists.txt").read_text()).group(1)
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert meta["appVersion"] == meta["version"] == version
    assert _container(_render({}))["image"] == f"attnd:{version}"
    assert _container(_render(VARIANTS["token"]))["image"] == "attnd:0.3.0-rc1"


def test_the_chart_and_the_plain_manifest_agree_where_both_set_a_flag():
    manifest = [d for d in yaml.safe_load_all(MANIFESTS.read_text()) if d]
    plain = next(d for d in manifest if d["kind"] == "StatefulSet")
    plain_args = dict(a.split("=", 1) for a in
                      plain["spec"]["template"]["spec"]["containers"][0]["args"])
    chart_args = _args(_render({}))
    shared = plain_args.keys() & chart_args.keys()
    assert len(shared) >= 10, shared
    assert {k: plain_args[k] for k in shared} == {k: chart_args[k] for k in shared}


def test_the_dashboard_configmap_holds_the_dashboard():
    cm = _one(_render({}), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((ROOT / "deploy" / "grafana" / "attnd-dashboard.json").read_text())
    assert json.loads(cm["data"]["attnd-dashboard.json"]) == shipped


@pytest.mark.parametrize("values, message", [
    ({"auth": {"mode": "mtls", "adminTenant": "ops"}}, "needs tls.enabled and tls.clientAuth"),
    ({"tls": {"clientAuth": True}}, "tls.clientAuth needs tls.enabled"),
    ({"auth": {"adminTenant": "ops"}}, "adminTenant needs auth.mode token or mtls"),
    ({"auth": {"mode": "token"}}, "needs auth.adminTenant"),
    ({"auth": {"mode": "oauth", "adminTenant": "ops"}}, "auth.mode: none, token or mtls"),
    ({"antiAffinity": "sometimes"}, "antiAffinity: soft, hard or none"),
])
def test_configurations_that_cannot_work_are_refused_with_a_reason(values, message):
    with pytest.raises(Fail, match=re.escape(message)):
        _render(values)


def test_the_renderer_is_strict():
    """A value that values.yaml does not declare, a missing path and an unknown function fail:
    helm_render cannot pass a chart that helm would render differently by leniency."""
    with pytest.raises(TemplateError, match="not in values.yaml"):
        _render({"replica": 3})
    chart = Chart(CHART)
    chart.defaults = {k: v for k, v in chart.defaults.items() if k != "drain"}
    with pytest.raises(TemplateError, match="drain"):
        chart.render()
    from helm_render import _parse  # the parser refuses unbalanced blocks
    with pytest.raises(TemplateError, match="without end"):
        _parse("{{ if .Values.x }}a")
    with pytest.raises(TemplateError, match="unknown function"):
        Chart(CHART)._eval([("ident", "lookup")], {}, {})


def _openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pod_files(tmp_path_factory):
    """What the chart mounts at /etc/attnd: a cert-manager-style TLS Secret (tls.crt, tls.key,
    ca.crt; the certificate's first SAN is the admin tenant, as mTLS drains need, and it names
    the Service) and the token Secret."""
    d = tmp_path_factory.mktemp("etc-attnd")
    tls, tokens = d / "tls", d / "tokens"
    tls.mkdir()
    tokens.mkdir()
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-days", "2", "-subj", "/CN=ca", "-keyout", str(d / "ca.key"),
             "-out", str(tls / "ca.crt"), "-addext", "basicConstraints=critical,CA:TRUE")
    (d / "ext").write_text("basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n"
                           "subjectAltName=DNS:ops,DNS:attnd,DNS:attnd.default.svc\n")
    _openssl("req", "-new", *ec, "-subj", "/CN=attnd", "-keyout", str(tls / "tls.key"),
             "-out", str(d / "csr"))
    _openssl("x509", "-req", "-in", str(d / "csr"), "-CA", str(tls / "ca.crt"), "-CAkey",
             str(d / "ca.key"), "-CAcreateserial", "-days", "2", "-extfile", str(d / "ext"),
             "-out", str(tls / "tls.crt"))
    (tokens / "tokens.txt").write_text("drain-secret-0123456789 ops\n"
                                       "worker-secret-0123456789 team-a\n")
    (tokens / "drain-token").write_text("drain-secret-0123456789\n")
    return d


@pytest.mark.parametrize("variant", ["defaults", "mtls", "token"])
def test_the_rendered_command_line_starts_attnd_and_its_probes_pass(variant, pod_files):
    """attnd started with the StatefulSet's args (the mounted paths pointed at files made here;
    the test's CPU device, tiny model, loopback ports and no peers after them), then each exec
    probe run as the kubelet would: all pass."""
    docs = _render(VARIANTS[variant])
    c = _container(docs)
    args = [a.replace("/etc/attnd", str(pod_files)) for a in c["args"]]
    proc, target, _ = start(["--devices=cpu:0", "--drain-peers=", "--standby-peers=",
                             "--shutdown-grace-ms=0"],
                            kv_pages=64, threads=1, first=args)
    try:
        port = target.rsplit(":", 1)[1]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if "grpc" in c[probe]:
                service = c[probe]["grpc"]["service"]
                cmd = ["attnctl", "health", f"--service={service}", f"--target={target}"]
            else:
                cmd = c[probe]["exec"]["command"]
            cmd = [str(ATTNCTL) if w == "attnctl" else
                   w.replace("/etc/attnd", str(pod_files)).replace(
                       "127.0.0.1:50051", f"127.0.0.1:{port}") for w in cmd]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, (probe, cmd, r.stdout, r.stderr)
            assert "SERVING" in r.stdout, r.stdout
    finally:
        stop(proc)


@pytest.mark.skipif(HELM is None, reason="helm is not installed: helm_render's check only")
@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lints_and_renders_the_same_objects(variant, tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(VARIANTS[variant]))
    subprocess.run([HELM, "lint", "--strict", str(CHART), "-f", str(values)], check=True)
    out = subprocess.run([HELM, "template", "attnd", str(CHART), "-f", str(values)],
                         check=True, capture_output=True, text=True).stdout
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    helm_docs = sorted((d for d in yaml.safe_load_all(out) if d), key=key)
    assert helm_docs == sorted(_render(VARIANTS[variant]), key=key)
