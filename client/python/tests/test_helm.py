"""The Helm chart (deploy/helm/attnd): rendered for several configurations (the defaults and one
with every feature on among them), each object validated strictly against the Kubernetes API's
schemas (the Prometheus Operator's against their CRDs' fields), checked to wire together, its
command line and probes run against a real attnd (TLS and mTLS with certificates made here), its
values checked by values.schema.json, its monitoring objects present only where wanted and
possible, its notes, and its refusals of configurations that cannot work. Rendered by helm_render
(a strict renderer of the chart's template subset); test_helm_renderers.py renders the same
variants with Go's own text/template and with helm where installed."""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_render import Chart, Fail, SchemaError, TemplateError
from test_deploy import CUSTOM_KINDS, MANIFESTS, VERSIONS, check_custom_resource, check_flags

from attnd_process import ATTND_BIN, ROOT, free_port, start, stop

CHART = ROOT / "deploy" / "helm" / "attnd"
ATTNCTL = ATTND_BIN.parent.parent / "client" / "attnctl"
HELM = shutil.which("helm")
GO = shutil.which("go")
OPERATOR = ("monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PrometheusRule")

# The default values' command line as the chart rendered it before the tiers, prefix cache, KV
# events and shared memory had values (those must not change what an upgrade runs), with the peer
# token that attnd's admin-only defaults need.
DEFAULT_ARGS = [
    "--devices=cuda:0", "--model=deepseek-v3.2", "--kv-cache-fraction=0.9", "--cache-dtype=bf16",
    "--grpc-port=50051", "--metrics-port=8002", "--step-idle-timeout-ms=30000",
    "--sequence-idle-timeout-s=0", "--shutdown-grace-ms=30000", "--drain-peers=dns:attnd:50051",
    "--drain-timeout-ms=90000", "--drain-parallel=4", "--auth=none",
    # Added with attnd's admin-only defaults: the replicas' shared admin token (docs/trust.md).
    "--admin-token-file=/etc/attnd/peer/token", "--drain-token-file=/etc/attnd/peer/token",
    "--quota-pages=0", "--quota-sequences=0", "--quota-steps=0"]

# Configurations a user would install: the defaults, mTLS with quotas and hard anti-affinity,
# bearer tokens, a bare one (no PDB, no monitoring, no ServiceAccount of its own, spread over
# zones, extra flags), and one with every feature on (numbers beyond a million among them, which
# Helm would print in e-notation unless the chart converts them).
VARIANTS = {
    "defaults": {},
    "mtls": {"tls": {"enabled": True, "clientAuth": True},
             "auth": {"mode": "mtls", "adminTenant": "ops"},
             "quotas": {"pages": 200000}, "antiAffinity": "hard",
             "extraArgs": ["--grpc-reflection=false"]},
    "token": {"tls": {"enabled": True}, "auth": {"mode": "token", "adminTenant": "ops"},
              "replicas": 3, "image": {"tag": "0.3.0-rc1"},
              "replication": {"enabled": True, "mode": "sync"},
              "serviceMonitor": {"force": True}},
    "bare": {"podDisruptionBudget": {"enabled": False}, "serviceMonitor": {"enabled": False},
             "prometheusRule": {"enabled": False}, "dashboard": {"enabled": False},
             "serviceAccount": {"create": False, "name": "gpu-workloads"},
             "antiAffinity": "none",
             "topologySpread": {"enabled": True}, "cache": {"dtype": "fp8"},
             "sequenceIdleTimeoutSeconds": 600, "extraArgs": ["--log-level=warning"],
             "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
             "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                              "effect": "NoSchedule"}]},
    "all-on": {"tls": {"enabled": True}, "auth": {"mode": "token", "adminTenant": "ops"},
               "replication": {"enabled": True, "mode": "sync", "standbyCacheBytes": 268435456},
               "tiers": {"host": {"bytes": 268435456},
                         "disk": {"bytes": 268435456, "size": "1Gi",
                                  "volume": "persistentVolumeClaim",
                                  "storageClassName": "local-nvme"},
                         "spillIdleMs": 600000},
               "prefixCache": {"bytes": 134217728},
               "kvEvents": {"enabled": True},
               "sharedMemory": {"enabled": True},
               "quotas": {"pages": 2000000, "shmRegions": 8},
               "drain": {"timeoutMs": 1200000}, "terminationGracePeriodSeconds": 1300,
               "serviceMonitor": {"force": True},
               "prometheusRule": {"force": True, "runbookBaseUrl": "https://example.org/attnd/"},
               "serviceAccount": {"name": "attnd-gpu", "annotations": {"team": "inference"}},
               "podSecurityContext": {"fsGroup": 65532},
               "extraContainers": [{"name": "worker", "image": "worker:1", "volumeMounts": [
                   {"name": "shm-socket", "mountPath": "/run/attnd"},
                   {"name": "dev-shm", "mountPath": "/dev/shm"}]}],
               "topologySpread": {"enabled": True},
               "networkPolicy": {
                   "enabled": True,
                   "clients": [{"podSelector": {"matchLabels": {"app": "model-worker"}}}],
                   "metrics": [{"namespaceSelector": {"matchLabels": {
                       "kubernetes.io/metadata.name": "monitoring"}}}],
                   "kvEvents": [{"podSelector": {"matchLabels": {"app": "router"}}}]}},
}
# The API versions the variant's cluster serves beyond Kubernetes' own (others: none).
CLUSTERS = {"mtls": OPERATOR}
BASE_KINDS = ["ConfigMap", "PodDisruptionBudget", "Service", "ServiceAccount", "StatefulSet"]
KINDS = {  # auth.mode none adds the peer token's Secret
    "defaults": sorted(BASE_KINDS + ["Secret"]),
    "mtls": sorted(BASE_KINDS + ["PrometheusRule", "ServiceMonitor"]),
    "token": sorted(BASE_KINDS + ["ServiceMonitor"]),
    "bare": ["Secret", "Service", "StatefulSet"],
    "all-on": sorted(BASE_KINDS + ["NetworkPolicy", "PrometheusRule", "ServiceMonitor"]),
}
# The flags whose values are files or directories in the pod.
PATH_FLAGS = {"--tls-cert", "--tls-key", "--tls-client-ca", "--drain-tls-ca", "--drain-tls-cert",
              "--drain-tls-key", "--auth-tokens", "--drain-token-file", "--admin-token-file",
              "--disk-cache-dir", "--shm-socket"}


def _render(values, api_versions=()):
    return Chart(CHART).render(values, api_versions=api_versions)


def _variant(name):
    return _render(VARIANTS[name], CLUSTERS.get(name, ()))


def _one(docs, kind):
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, (kind, [d["kind"] for d in docs])
    return found[0]


def _pod(docs):
    return _one(docs, "StatefulSet")["spec"]["template"]["spec"]


def _container(docs):
    return _pod(docs)["containers"][0]


def _args(docs):
    return dict(a.split("=", 1) for a in _container(docs)["args"])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_strictly_against_the_kubernetes_schemas(variant, version):
    docs = _variant(variant)
    assert sorted(d["kind"] for d in docs) == KINDS[variant]
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            check_custom_resource(doc)
        else:
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_objects_select_and_reach_each_other(variant):
    docs, values = _variant(variant), Chart(CHART).merged(VARIANTS[variant])
    svc, sts, c = _one(docs, "Service"), _one(docs, "StatefulSet"), _container(docs)
    pod = sts["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    selectors = [svc["spec"]["selector"], sts["spec"]["selector"]["matchLabels"]]
    if variant != "bare":
        selectors.append(_one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"])
    for mon in (d for d in docs if d["kind"] == "ServiceMonitor"):
        assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert mon["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        # The alerts and the dashboard select job="attnd": the job is this label's value.
        assert svc["metadata"]["labels"][mon["spec"]["jobLabel"]] == "attnd"
        assert {e["port"] for e in mon["spec"]["endpoints"]} <= {
            p["name"] for p in svc["spec"]["ports"]}
    spec = pod["spec"]
    for term in spec.get("affinity", {}).get("podAntiAffinity", {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution", []):
        selectors.append(term["labelSelector"]["matchLabels"])
    for term in spec.get("topologySpreadConstraints", []):
        selectors.append(term["labelSelector"]["matchLabels"])
    container_ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        selectors.append(policy["spec"]["podSelector"]["matchLabels"])
        selectors.append(policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"])
        for rule in policy["spec"]["ingress"]:
            assert rule["from"], rule  # a rule without peers would admit everyone
            assert {p["port"] for p in rule.get("ports", [])} <= container_ports.keys(), rule
    for selector in selectors:
        assert selector and selector.items() <= pod_labels.items()
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["replicas"] == values["replicas"]
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == container_ports.keys()
    args = _args(docs)
    assert args["--grpc-port"] == str(container_ports["grpc"])
    assert args["--metrics-port"] == str(container_ports["metrics"])
    assert args["--drain-peers"] == f"dns:{svc['metadata']['name']}:{container_ports['grpc']}"
    if "--kv-events" in args:
        assert args["--kv-events"] == f"tcp://*:{container_ports['kv-events']}"
    else:
        assert "kv-events" not in container_ports
    drain_s = (int(args["--drain-timeout-ms"]) + int(args["--shutdown-grace-ms"])) / 1000
    assert spec["terminationGracePeriodSeconds"] > drain_s
    # Probes: liveness on the server's health, readiness on the service the drain turns off.
    for probe, service in (("startupProbe", ""), ("livenessProbe", ""),
                           ("readinessProbe", "attnd.v1.Attention")):
        if "grpc" in c[probe]:
            assert not values["tls"]["enabled"]
            assert c[probe]["grpc"] == {"port": container_ports["grpc"], "service": service}
        else:
            cmd = c[probe]["exec"]["command"]
            assert cmd[:3] == ["attnctl", "health", f"--service={service}"], cmd
            assert f"--target=127.0.0.1:{container_ports['grpc']}" in cmd
    assert c["readinessProbe"]["failureThreshold"] >= 2
    # The pod runs under the ServiceAccount the chart made (or was told to use), without its token.
    accounts = [d for d in docs if d["kind"] == "ServiceAccount"]
    if accounts:
        assert spec["serviceAccountName"] == accounts[0]["metadata"]["name"]
        assert accounts[0]["automountServiceAccountToken"] is False
    else:
        assert spec["serviceAccountName"] == values["serviceAccount"]["name"]
    assert spec["automountServiceAccountToken"] is False
    # Every file or directory the flags name is in a mounted volume, and every mount is a volume
    # of the pod or a claim of the StatefulSet.
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    for flag, path in args.items():
        if flag in PATH_FLAGS:
            assert any(path == m or path.startswith(m + "/") for m in mounts), (flag, path)
    volumes = {v["name"] for v in spec.get("volumes", [])}
    claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
    assert not volumes & claims
    for container in spec["containers"]:
        for m in container.get("volumeMounts", []):
            assert m["name"] in volumes | claims, (container["name"], m)
    check_flags(c["args"])


def test_the_default_command_line_is_the_one_before_the_new_values():
    assert _container(_render({}))["args"] == DEFAULT_ARGS


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


def test_the_chart_holds_real_files_equal_to_the_canonical_ones():
    """`helm package` drops what a symlink out of the chart points at: the chart holds copies,
    byte for byte the files deploy/grafana and deploy/prometheus keep (the ones to edit)."""
    links = [p for p in CHART.rglob("*") if p.is_symlink()]
    assert not links, f"symlinks in the chart: {links}"
    canonical = {"attnd-dashboard.json": ROOT / "deploy" / "grafana" / "attnd-dashboard.json",
                 "attnd-rules.yaml": ROOT / "deploy" / "prometheus" / "attnd-rules.yaml"}
    assert sorted(p.name for p in (CHART / "files").iterdir()) == sorted(canonical)
    for name, source in canonical.items():
        assert (CHART / "files" / name).read_bytes() == source.read_bytes(), (
            f"files/{name} differs from {source.relative_to(ROOT)}: cp {source.relative_to(ROOT)}"
            f" {(CHART / 'files' / name).relative_to(ROOT)}")


def _runbooks(spec):
    return [r["annotations"]["runbook_url"] for g in spec["groups"] for r in g["rules"]]


def test_the_prometheus_rule_is_the_canonical_rules_with_absolute_runbook_links():
    canonical = yaml.safe_load((ROOT / "deploy" / "prometheus" / "attnd-rules.yaml").read_text())
    rule = _one(_render({"prometheusRule": {"force": True}}), "PrometheusRule")
    assert rule["spec"] == canonical["spec"]
    base = "https://example.org/attnd/blob/v0.3.0/"
    linked = _one(_render({"prometheusRule": {"force": True, "runbookBaseUrl": base}}),
                  "PrometheusRule")["spec"]
    assert _runbooks(linked) == [base + u for u in _runbooks(canonical["spec"])]
    assert len(_runbooks(linked)) == sum(len(g["rules"]) for g in linked["groups"]) >= 11
    for g in linked["groups"]:  # nothing else changed
        for r in g["rules"]:
            r["annotations"]["runbook_url"] = r["annotations"]["runbook_url"][len(base):]
    assert linked == canonical["spec"]


SM, PR = "ServiceMonitor", "PrometheusRule"


@pytest.mark.parametrize("values, api_versions, installed, notes", [
    ({}, (), set(), ["ServiceMonitor: not installed: the cluster does not serve",
                     "PrometheusRule: not installed: the cluster does not serve",
                     "set serviceMonitor.force=true", "set prometheusRule.force=true"]),
    ({}, OPERATOR, {SM, PR}, ["ServiceMonitor attnd: installed.",
                              "PrometheusRule attnd: installed.\n  AttndDown"]),
    ({}, OPERATOR[:1], {SM}, ["ServiceMonitor attnd: installed.",
                              "PrometheusRule: not installed: the cluster does not serve"]),
    ({"serviceMonitor": {"enabled": False}, "prometheusRule": {"enabled": False}}, OPERATOR,
     set(), ["ServiceMonitor: not installed (serviceMonitor.enabled=false)",
             "PrometheusRule: not installed (prometheusRule.enabled=false)"]),
    ({"serviceMonitor": {"force": True}, "prometheusRule": {"force": True}}, (), {SM, PR},
     ["ServiceMonitor attnd: installed (forced: the cluster does not list its API yet)",
      "PrometheusRule attnd: installed (forced: the cluster does not list its API yet)"]),
    ({"serviceMonitor": {"enabled": False, "force": True}}, OPERATOR, {PR},
     ["ServiceMonitor: not installed (serviceMonitor.enabled=false)"]),
])
def test_monitoring_objects_need_their_value_and_the_clusters_api(values, api_versions,
                                                                  installed, notes):
    """A cluster without the Prometheus Operator's CRDs would refuse the whole install over one
    ServiceMonitor: each operator object goes in only when wanted and served (or forced), and the
    notes say which went in and why the others did not."""
    docs = _render(values, api_versions)
    assert {d["kind"] for d in docs} & {SM, PR} == installed
    text = Chart(CHART).notes(values, api_versions=api_versions)
    for phrase in notes:
        assert phrase in text, (phrase, text)
    if SM in installed:
        assert "ServiceMonitor: not installed" not in text


def test_the_notes_say_how_to_reach_and_check_the_service():
    text = Chart(CHART).notes({}, namespace="ml")
    assert "dns:///attnd.ml.svc:50051" in text
    health = "kubectl -n ml exec attnd-0 -c attnd -- attnctl health --target=127.0.0.1:50051\n"
    assert health in text
    assert "Grafana dashboard: the ConfigMap attnd-dashboard" in text
    assert "KV events" not in text and "Shared memory" not in text
    # Under mTLS the health check verifies the server name and presents the pod's certificate,
    # as the probes do; the extra families say where they are reached.
    text = Chart(CHART).notes(VARIANTS["mtls"])
    probe = _container(_variant("mtls"))["readinessProbe"]["exec"]["command"]
    tls_flags = [w for w in probe if w.startswith("--tls-")]
    assert len(tls_flags) == 4
    assert f"attnctl health --target=127.0.0.1:50051 {' '.join(tls_flags)}\n" in text
    text = Chart(CHART).notes(VARIANTS["all-on"])
    assert "KV events (ZeroMQ SUB, vLLM's schema): tcp://<pod>.attnd.default.svc:5557" in text
    assert "Shared memory: unix:/run/attnd/attnd.sock" in text
    assert "Tokens: a line \"TOKEN TENANT\" per client in tokens.txt of the Secret attnd-tokens" \
        in text
    assert "--token-file=/etc/attnd/tokens/drain-token" in text  # attnctl info needs a token


def _schema():
    return json.loads((CHART / "values.schema.json").read_text())


def _defaults():
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _over(base, values):
    out = copy.deepcopy(base)
    for k, v in values.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _over(out[k], v)
        else:
            out[k] = v
    return out


def test_the_schema_is_draft_07_and_types_every_value():
    schema = _schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["additionalProperties"] is False
    jsonschema.validate(_defaults(), schema)
    for variant in VARIANTS.values():
        jsonschema.validate(_over(_defaults(), variant), schema)

    def walk(value, node, path):
        assert node, f"{path}: not in values.schema.json"
        assert {"type", "enum", "const", "oneOf", "anyOf"} & node.keys(), f"{path}: untyped"
        if isinstance(value, dict) and "properties" in node:
            assert node.get("additionalProperties") is False, f"{path}: open to misspellings"
            assert sorted(node.get("required", [])) == sorted(value), path
            for k, v in value.items():
                walk(v, node["properties"][k], f"{path}.{k}")

    walk(_defaults(), schema, "values")


@pytest.mark.parametrize("values, where", [
    ({"replica": 3}, "(root)"),                                   # misspelt
    ({"cache": {"dtpye": "fp8"}}, "cache"),
    ({"tiers": {"disk": {"sizeLimit": "1Gi"}}}, "tiers.disk"),
    ({"cache": {"dtype": "fp16"}}, "cache.dtype"),                # not an enumerated value
    ({"auth": {"mode": "oauth"}}, "auth.mode"),
    ({"replication": {"mode": "semi-sync"}}, "replication.mode"),
    ({"antiAffinity": "sometimes"}, "antiAffinity"),
    ({"tiers": {"disk": {"volume": "hostPath"}}}, "tiers.disk.volume"),
    ({"replicas": "2"}, "replicas"),                              # of the wrong type
    ({"tiers": {"host": {"bytes": "64Gi"}}}, "tiers.host.bytes"),
    ({"prefixCache": {"bytes": "most"}}, "prefixCache.bytes"),
    ({"kvEvents": {"enabled": "yes"}}, "kvEvents.enabled"),
    ({"drain": {"parallel": 0}}, "drain.parallel"),               # out of range
    ({"drain": {"parallel": 65}}, "drain.parallel"),
    ({"dataPlane": {"keepaliveMs": 50}}, "dataPlane.keepaliveMs"),  # attnd refuses 1-99
    ({"ports": {"grpc": 70000}}, "ports.grpc"),
    ({"replicas": 0}, "replicas"),
    ({"cache": {"fraction": 1.5}}, "cache.fraction"),
    ({"tiers": {"disk": {"size": "600 GB"}}}, "tiers.disk.size"),  # malformed
    ({"extraArgs": ["log-level=info"]}, "extraArgs.0"),
    ({"podSecurityContext": {"runAsNonRoot": False}}, "podSecurityContext"),  # the chart's own
    ({"prometheusRule": {"runbookBaseUrl": "docs.example.org"}}, "prometheusRule.runbookBaseUrl"),
    ({"networkPolicy": {"clients": [{"podselector": {}}]}}, "networkPolicy.clients.0"),
])
def test_the_schema_refuses_misspelt_and_mistyped_values(values, where):
    errors = list(jsonschema.Draft7Validator(_schema()).iter_errors(_over(_defaults(), values)))
    assert errors
    assert where in {".".join(map(str, e.absolute_path)) or "(root)" for e in errors}, errors
    # Helm checks the schema before it renders; so does helm_render (a key values.yaml lacks is
    # refused even before that).
    with pytest.raises((SchemaError, TemplateError)):
        _render(values)


@pytest.mark.parametrize("values, error, message", [
    ({"auth": {"mode": "mtls", "adminTenant": "ops"}}, Fail,
     "needs tls.enabled and tls.clientAuth"),
    ({"tls": {"clientAuth": True}}, Fail, "tls.clientAuth needs tls.enabled"),
    ({"auth": {"adminTenant": "ops"}}, Fail, "adminTenant needs auth.mode token or mtls"),
    ({"auth": {"mode": "token"}}, Fail, "needs auth.adminTenant"),
    ({"tiers": {"disk": {"bytes": 1 << 30}}}, Fail, "tiers.disk.bytes needs tiers.disk.size"),
    ({"tiers": {"spillIdleMs": 1000}}, Fail, "tiers.spillIdleMs needs a tier to spill to"),
    ({"replication": {"leaseMs": 500}}, Fail,
     "replication.leaseMs: 0, or at least replication.ackTimeoutMs"),
    ({"dataPlane": {"enabled": True}, "tls": {"enabled": True}}, Fail,
     "dataPlane.enabled with tls.enabled needs dataPlane.withoutTls: UCX does not encrypt"),
    ({"networkPolicy": {"enabled": True}}, Fail,
     "networkPolicy.clients: list the peers that call attnd"),
    ({"networkPolicy": {"enabled": True, "clients": [{"podSelector": {}}]},
      "kvEvents": {"enabled": True}}, Fail,
     "networkPolicy.kvEvents: list the routers that subscribe"),
    ({"auth": {"mode": "oauth", "adminTenant": "ops"}}, SchemaError,
     "auth.mode: 'oauth' is not one of ['none', 'token', 'mtls']"),
    ({"antiAffinity": "sometimes"}, SchemaError,
     "antiAffinity: 'sometimes' is not one of ['soft', 'hard', 'none']"),
])
def test_configurations_that_cannot_work_are_refused_with_a_reason(values, error, message):
    with pytest.raises(error, match=re.escape(message)):
        _render(values)


@pytest.mark.parametrize("values, flags", [
    ({"tiers": {"host": {"bytes": 68719476736}}}, ["--host-cache-bytes=68719476736"]),
    ({"tiers": {"disk": {"bytes": 549755813888, "size": "600Gi"}, "spillIdleMs": 600000}},
     ["--disk-cache-dir=/var/cache/attnd", "--disk-cache-bytes=549755813888",
      "--spill-idle-ms=600000"]),
    ({"prefixCache": {"enabled": False}}, ["--prefix-cache-bytes=0"]),
    ({"prefixCache": {"bytes": 17179869184}}, ["--prefix-cache-bytes=17179869184"]),
    ({"kvEvents": {"enabled": True, "port": 6000}},
     ["--kv-events=tcp://*:6000", "--kv-events-replay=tcp://*:5558"]),
    ({"kvEvents": {"enabled": True, "replayPort": 0, "format": "array"}},
     ["--kv-events=tcp://*:5557", "--kv-events-format=array"]),
    ({"sharedMemory": {"enabled": True, "socketDir": "/run/shm-attnd", "socketMode": "0600"},
      "quotas": {"shmRegions": 4}},
     ["--shm=true", "--shm-socket=/run/shm-attnd/attnd.sock", "--shm-socket-mode=0600",
      "--shm-prefix=/attnd-", "--quota-shm-regions=4"]),
    ({"replication": {"enabled": True, "standbyCacheBytes": 8589934592}},
     ["--standby-peers=dns:attnd:50051", "--replication=async", "--replication-max-lag-steps=4",
      "--replication-ack-timeout-ms=1000", "--replication-lease-ms=2000",
      "--standby-cache-bytes=8589934592"]),
    ({"dataPlane": {"enabled": True, "regionBytes": 67108864, "timeoutMs": 500}},
     ["--data-plane=ucx", "--data-plane-region-bytes=67108864", "--data-plane-max-planes=64",
      "--data-plane-timeout-ms=500", "--data-plane-push=false", "--data-plane-keepalive-ms=5000"]),
    ({"dataPlane": {"enabled": True, "withoutTls": True, "push": True, "keepaliveMs": 0}},
     ["--data-plane=ucx", "--data-plane-region-bytes=268435456", "--data-plane-max-planes=64",
      "--data-plane-timeout-ms=2000", "--data-plane-push=true", "--data-plane-keepalive-ms=0",
      "--data-plane-without-tls=true"]),
    ({"quotas": {"pages": 5000000}, "drain": {"timeoutMs": 3600000},
      "terminationGracePeriodSeconds": 3700},
     ["--quota-pages=5000000", "--drain-timeout-ms=3600000"]),
])
def test_each_value_family_maps_to_attnds_flags(values, flags):
    """The flags appear with their values as attnd reads them (digits, whatever the size), added
    to the default command line, nothing of it changed."""
    args = _container(_render(values))["args"]
    for flag in flags:
        assert flag in args, (flag, args)
    names = {f.split("=", 1)[0] for f in flags}
    assert [a for a in args if a.split("=", 1)[0] not in names] == [
        a for a in DEFAULT_ARGS if a.split("=", 1)[0] not in names]
    check_flags(args)


def test_the_data_plane_passes_ucx_tls_to_attnd_only_when_given():
    assert "env" not in _container(_render({"dataPlane": {"enabled": True}}))
    env = _container(_render({"dataPlane": {"enabled": True, "ucxTls": "sm,tcp"}}))["env"]
    assert env == [{"name": "UCX_TLS", "value": "sm,tcp"}]


def test_the_disk_tier_gets_a_volume_of_its_size():
    tier = {"bytes": 549755813888, "size": "600Gi"}
    docs = _render({"tiers": {"disk": tier}})
    assert {"name": "tier", "emptyDir": {"sizeLimit": "600Gi"}} in _pod(docs)["volumes"]
    assert {"name": "tier", "mountPath": "/var/cache/attnd"} in _container(docs)["volumeMounts"]
    assert "volumeClaimTemplates" not in _one(docs, "StatefulSet")["spec"]
    docs = _render({"tiers": {"disk": {**tier, "volume": "persistentVolumeClaim",
                                       "storageClassName": "local-nvme"}}})
    sts = _one(docs, "StatefulSet")
    assert sts["spec"]["volumeClaimTemplates"] == [{"metadata": {"name": "tier"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "storageClassName": "local-nvme",
        "resources": {"requests": {"storage": "600Gi"}}}}]
    assert "tier" not in {v["name"] for v in _pod(docs)["volumes"]}  # the claim's, not the pod's
    assert {"name": "tier", "mountPath": "/var/cache/attnd"} in _container(docs)["volumeMounts"]


def test_kv_events_and_shared_memory_get_their_port_and_volumes():
    docs = _render({"kvEvents": {"enabled": True}, "sharedMemory": {"enabled": True,
                                                                    "size": "4Gi"}})
    svc_ports = {p["name"]: p for p in _one(docs, "Service")["spec"]["ports"]}
    assert svc_ports["kv-events"]["port"] == 5557
    assert svc_ports["kv-events"]["targetPort"] == "kv-events"
    assert {"name": "kv-events", "containerPort": 5557} in _container(docs)["ports"]
    assert svc_ports["kv-replay"]["port"] == 5558
    assert {"name": "kv-replay", "containerPort": 5558} in _container(docs)["ports"]
    volumes = {v["name"]: v for v in _pod(docs)["volumes"]}
    assert volumes["dev-shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    assert volumes["shm-socket"]["emptyDir"] == {}
    mounts = {m["name"]: m["mountPath"] for m in _container(docs)["volumeMounts"]}
    assert mounts == {"dev-shm": "/dev/shm", "shm-socket": "/run/attnd",
                      "peer-token": "/etc/attnd/peer"}
    assert "kv-events" not in {p["name"] for p in _one(_render({}), "Service")["spec"]["ports"]}


def test_the_pod_has_its_own_account_no_token_no_fixed_user_and_no_privileges():
    docs = _render({})
    account = _one(docs, "ServiceAccount")
    assert account["metadata"]["name"] == "attnd"
    assert account["automountServiceAccountToken"] is False
    pod, c = _pod(docs), _container(docs)
    assert pod["serviceAccountName"] == "attnd" and pod["automountServiceAccountToken"] is False
    # OpenShift assigns the user (and refuses one outside its range): none is fixed.
    assert pod["securityContext"] == {"runAsNonRoot": True,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    docs = _render({"serviceAccount": {"name": "gpu"}, "podSecurityContext": {"fsGroup": 2000}})
    assert _one(docs, "ServiceAccount")["metadata"]["name"] == "gpu"
    assert _pod(docs)["serviceAccountName"] == "gpu"
    assert _pod(docs)["securityContext"]["fsGroup"] == 2000
    assert _pod(docs)["securityContext"]["runAsNonRoot"] is True
    docs = _render({"serviceAccount": {"create": False}})
    assert "ServiceAccount" not in {d["kind"] for d in docs}
    assert _pod(docs)["serviceAccountName"] == "default"


def test_the_renderer_is_strict():
    """A value that values.yaml does not declare, a missing path, an unknown function and a
    number Helm would print in e-notation fail: helm_render cannot pass a chart that helm would
    render differently by leniency."""
    with pytest.raises(TemplateError, match="not in values.yaml"):
        _render({"replica": 3})
    chart = Chart(CHART)
    chart.defaults = {k: v for k, v in chart.defaults.items() if k != "drain"}
    chart.schema = None
    with pytest.raises(TemplateError, match="drain"):
        chart.render()
    from helm_render import _parse, _text  # the parser refuses unbalanced blocks
    with pytest.raises(TemplateError, match="without end"):
        _parse("{{ if .Values.x }}a")
    with pytest.raises(TemplateError, match="unknown function"):
        Chart(CHART)._eval([("ident", "genCA")], {}, {})
    # Helm's values are float64s: 68719476736 prints as 6.8719476736e+10, 0.9 as 0.9.
    with pytest.raises(TemplateError, match=re.escape("6.8719476736e+10: pipe it through int64")):
        _text(68719476736)
    assert _text(999999) == "999999" and _text(0.9) == "0.9"


def _openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pod_files(tmp_path_factory):
    """What the chart mounts at /etc/attnd: a cert-manager-style TLS Secret (tls.crt, tls.key,
    ca.crt; the certificate's first SAN is the admin tenant, as mTLS drains need, and it names
    the Service), the token Secret and the peer token's."""
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
    (d / "peer").mkdir()  # auth.mode none: the replicas' shared admin token
    (d / "peer" / "token").write_text("peer-secret-0123456789\n")
    return d


def _pod_paths(container, pod_files, tmp_path):
    """Each of the container's mounts as a directory here: the Secrets' files pod_files made, an
    empty directory for the others (the disk tier, the shared-memory socket). /dev/shm is the
    machine's own."""
    paths = {}
    for m in container.get("volumeMounts", []):
        mount = m["mountPath"]
        if mount == "/dev/shm":
            continue
        if mount.startswith("/etc/attnd/"):
            paths[mount] = pod_files / mount.removeprefix("/etc/attnd/")
        else:
            paths[mount] = tmp_path / mount.strip("/")
            paths[mount].mkdir(parents=True)
    return paths


def _here(word, paths):
    for mount, local in paths.items():
        word = word.replace(mount, str(local))
    return word


@pytest.mark.parametrize("variant", ["defaults", "mtls", "token", "all-on"])
def test_the_rendered_command_line_starts_attnd_and_its_probes_pass(variant, pod_files, tmp_path):
    """attnd started with the StatefulSet's args (the mounted paths pointed at directories made
    here; the test's CPU device, tiny model, loopback ports, a free KV-events port and no peers
    after them), then each exec probe run as the kubelet would: all pass."""
    c = _container(_variant(variant))
    paths = _pod_paths(c, pod_files, tmp_path)
    args = [_here(a, paths) for a in c["args"]]
    extra = ["--devices=cpu:0", "--drain-peers=", "--standby-peers=", "--shutdown-grace-ms=0"]
    if any(a.startswith("--kv-events=") for a in args):
        extra.append(f"--kv-events=tcp://127.0.0.1:{free_port()}")
    proc, target, _ = start(extra, kv_pages=64, threads=1, first=args)
    try:
        port = target.rsplit(":", 1)[1]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if "grpc" in c[probe]:
                service = c[probe]["grpc"]["service"]
                cmd = ["attnctl", "health", f"--service={service}", f"--target={target}"]
            else:
                cmd = c[probe]["exec"]["command"]
            cmd = [str(ATTNCTL) if w == "attnctl" else
                   _here(w, paths).replace("127.0.0.1:50051", f"127.0.0.1:{port}") for w in cmd]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, (probe, cmd, r.stdout, r.stderr)
            assert "SERVING" in r.stdout, r.stdout
    finally:
        stop(proc)


def test_without_auth_the_pods_share_a_peer_token_for_drains_and_standby_copies():
    """Without auth a drain's moves and standby copies are admin calls that attnd serves off
    loopback only to the bearer of --admin-token-file: every pod mounts one Secret's token and
    presents it to its peers. The chart makes the Secret (kept on uninstall, as running pods use
    it) unless auth.peerTokenSecret names one; token and mtls auth need none."""
    docs = _render({})
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert secret["metadata"]["name"] == "attnd-peer-token"
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(base64.b64decode(secret["data"]["token"])) >= 16
    args = _container(docs)["args"]
    assert "--admin-token-file=/etc/attnd/peer/token" in args
    assert "--drain-token-file=/etc/attnd/peer/token" in args
    assert {"name": "peer-token", "secret": {"secretName": "attnd-peer-token"}} in \
        _pod(docs)["volumes"]
    assert {"name": "peer-token", "mountPath": "/etc/attnd/peer", "readOnly": True} in \
        _container(docs)["volumeMounts"]
    mine = _render({"auth": {"peerTokenSecret": "our-token"}})
    assert not [d for d in mine if d["kind"] == "Secret"]
    assert {"name": "peer-token", "secret": {"secretName": "our-token"}} in _pod(mine)["volumes"]
    for variant in ("token", "mtls"):
        docs = _render(VARIANTS[variant])
        assert not [d for d in docs if d["kind"] == "Secret"], variant
        assert not [a for a in _container(docs)["args"] if a.startswith("--admin-token-file")]
