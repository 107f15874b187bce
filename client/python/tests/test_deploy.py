"""The deployment files: the Kubernetes manifests validated offline against the Kubernetes API's
own schemas (kubernetes-validate, strict: unknown fields are errors) and the Prometheus
Operator's objects against the fields of its CRDs, checked to wire together (selectors, ports,
probes, the flags attnd accepts), the Dockerfile's command line parsed by the attnd that was
built; the alerts run through `promtool test rules`, each with a runbook section, and every
dashboard query filtered by the dashboard's namespace, job and pod variables."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml

from attnd_process import ATTND_BIN, ROOT

MANIFESTS = ROOT / "deploy" / "kubernetes" / "attnd.yaml"
RULES = ROOT / "deploy" / "prometheus" / "attnd-rules.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "attnd-dashboard.json"
RUNBOOKS = ROOT / "docs" / "lifecycle.md"
# The oldest Kubernetes the manifests are for (gRPC probes are GA from 1.27) and the newest whose
# schemas kubernetes-validate carries.
VERSIONS = ["1.28.0", kubernetes_validate.latest_version()]
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}  # CRDs: no schema in the Kubernetes API

# The Prometheus Operator's CRDs (monitoring.coreos.com/v1), as far as attnd's objects go: their
# required fields and types, and at each level the property names the CRD defines (a subset: a
# misspelt field is refused, as the API server's structural schema would prune it unseen).
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
             r"(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {"type": "object", "required": ["name"],
             "properties": {"name": {"type": "string", "minLength": 1}, "labels": _STRINGS,
                            "annotations": _STRINGS, "namespace": {"type": "string"}}}
_SELECTOR = {"type": "object", "additionalProperties": False,
             "properties": {"matchLabels": _STRINGS, "matchExpressions": {"type": "array"}}}


def _crd(kind, spec):
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
            "additionalProperties": False,
            "properties": {"apiVersion": {"const": "monitoring.coreos.com/v1"},
                           "kind": {"const": kind}, "metadata": _METADATA, "spec": spec}}


CRD_SCHEMAS = {
    "ServiceMonitor": _crd("ServiceMonitor", {
        "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
        "properties": {
            "selector": _SELECTOR, "jobLabel": {"type": "string"},
            "namespaceSelector": {"type": "object"}, "podTargetLabels": {"type": "array"},
            "targetLabels": {"type": "array"}, "sampleLimit": {"type": "integer"},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False,
                "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                               "interval": _DURATION, "scrapeTimeout": _DURATION,
                               "scheme": {"enum": ["http", "https"]},
                               "tlsConfig": {"type": "object"},
                               "honorLabels": {"type": "boolean"},
                               "relabelings": {"type": "array"},
                               "metricRelabelings": {"type": "array"}}}}}}),
    "PrometheusRule": _crd("PrometheusRule", {
        "type": "object", "required": ["groups"], "additionalProperties": False,
        "properties": {"groups": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "rules"], "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "minLength": 1}, "interval": _DURATION,
                "rules": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["expr"], "additionalProperties": False,
                    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                    "properties": {"alert": {"type": "string"}, "record": {"type": "string"},
                                   "expr": {"type": ["string", "integer"]}, "for": _DURATION,
                                   "keep_firing_for": _DURATION, "labels": _STRINGS,
                                   "annotations": _STRINGS}}}}}}}}),
}


def check_custom_resource(doc):
    """A Prometheus Operator object (CUSTOM_KINDS) against CRD_SCHEMAS; raises
    jsonschema.ValidationError."""
    jsonschema.validate(doc, CRD_SCHEMAS[doc["kind"]])


# Grafana's value of each dashboard variable when "All" is picked (their allValue).
DASHBOARD_ALL = {"$namespace": ".*", "$job": ".*", "$pod": ".*"}


def dashboard_query(expr):
    """A dashboard panel's query as Grafana sends it with every variable on All: PromQL that
    Prometheus (or promtool) reads."""
    for var, value in DASHBOARD_ALL.items():
        expr = expr.replace(var, value)
    return expr


def _docs():
    docs = [d for d in yaml.safe_load_all(MANIFESTS.read_text()) if d]
    docs += [d for d in yaml.safe_load_all(RULES.read_text()) if d]
    return docs


def _by_kind(kind):
    found = [d for d in _docs() if d["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def _container():
    return _by_kind("StatefulSet")["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate_strictly_against_the_kubernetes_schemas(version):
    kinds, custom = [], []
    for doc in _docs():
        if doc["kind"] in CUSTOM_KINDS:
            check_custom_resource(doc)
            custom.append(doc["kind"])
            continue
        kubernetes_validate.validate(doc, version, strict=True)
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["PodDisruptionBudget", "Service", "StatefulSet"]
    assert sorted(custom) == ["PrometheusRule", "ServiceMonitor"]


def test_the_operator_objects_check_can_fail():
    """A ServiceMonitor without its selector, a misspelt endpoint field, a rule without expr and
    a bad duration are refused: the CRD check is not vacuous."""
    mon, rules = _by_kind("ServiceMonitor"), _by_kind("PrometheusRule")
    broken = []
    b = copy.deepcopy(mon)
    del b["spec"]["selector"]
    broken.append(b)
    b = copy.deepcopy(mon)
    b["spec"]["endpoints"][0]["intervall"] = "15s"
    broken.append(b)
    b = copy.deepcopy(rules)
    del b["spec"]["groups"][0]["rules"][0]["expr"]
    broken.append(b)
    b = copy.deepcopy(rules)
    b["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"
    broken.append(b)
    b = copy.deepcopy(rules)
    b["apiVersion"] = "monitoring.coreos.com/v1beta1"
    broken.append(b)
    for doc in broken:
        with pytest.raises(jsonschema.ValidationError):
            check_custom_resource(doc)


def test_the_validation_can_fail():
    """A typo'd field and a wrongly typed one are refused: the check above is not vacuous."""
    sts = _by_kind("StatefulSet")
    typo = copy.deepcopy(sts)
    typo["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 150
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, VERSIONS[-1], strict=True)
    wrong = copy.deepcopy(sts)
    wrong["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, VERSIONS[-1], strict=True)


def test_the_pieces_select_and_reach_each_other():
    svc, sts = _by_kind("Service"), _by_kind("StatefulSet")
    pdb, mon = _by_kind("PodDisruptionBudget"), _by_kind("ServiceMonitor")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    for selector in (svc["spec"]["selector"], sts["spec"]["selector"]["matchLabels"],
                     pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= pod_labels.items()
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None"  # headless: the drain and clients see every pod
    container_ports = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    for name, port in svc_ports.items():
        assert port["targetPort"] in container_ports, name
    assert svc_ports["grpc"]["appProtocol"] == "grpc"
    assert {e["port"] for e in mon["spec"]["endpoints"]} <= svc_ports.keys()
    # Probes: liveness on the server's health, readiness on the service the drain turns off.
    c = _container()
    assert c["readinessProbe"]["grpc"]["service"] == "attnd.v1.Attention"
    assert c["livenessProbe"]["grpc"]["service"] == ""
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == container_ports["grpc"], probe
    # The pod may run as long as the drain and the shutdown grace take.
    args = dict(a.split("=", 1) for a in c["args"] if "=" in a)
    assert args["--grpc-port"] == str(container_ports["grpc"])
    assert args["--metrics-port"] == str(container_ports["metrics"])
    drain_s = (int(args["--drain-timeout-ms"]) + int(args["--shutdown-grace-ms"])) / 1000
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_s
    assert args["--drain-peers"].startswith(f"dns:{svc['metadata']['name']}:")


def test_the_pod_is_pinned_filtered_and_tolerates_one_slow_probe():
    sts, c = _by_kind("StatefulSet"), _container()
    image, _, tag = c["image"].rpartition(":")
    version = re.search(r"project\(attnd VERSION ([0-9.]+)",
                        (ROOT / "CMakeLists.txt").read_text()).group(1)
    assert tag == version, f"{c['image']}: pin the release ({version}), not {tag or 'no tag'}"
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    assert f'org.opencontainers.image.version="{version}"' in docker
    assert f"-t {image}:{version} " in docker, "the Dockerfile's build line makes that tag"
    pod = sts["spec"]["template"]["spec"]["securityContext"]
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"} and pod["runAsNonRoot"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["readinessProbe"]["failureThreshold"] >= 2


def check_flags(argv):
    """Every flag in `argv` is one `attnd --help` lists (their values are attnd's flag parser's
    to check: flags_test; a manifest value it refused would keep the pod from starting)."""
    known = set(re.findall(r"^  (--[a-z0-9-]+)", subprocess.run(
        [str(ATTND_BIN), "--help"], capture_output=True, text=True, check=True).stdout, re.M))
    assert known, "attnd --help lists no flags"
    for a in argv:
        assert a.split("=", 1)[0] in known, f"{a}: attnd has no such flag"
    return known


def test_the_manifest_and_dockerfile_pass_only_flags_attnd_accepts():
    container_args = [a for a in _container()["args"] if a.startswith("--")]
    known = check_flags(container_args)
    # The commented-out multi-tenant flags too: uncommenting them must give a working line.
    commented = re.findall(r"^\s*#\s*- (--[a-z0-9-]+=\S+)", MANIFESTS.read_text(), re.M)
    assert len(commented) >= 5
    for a in commented:
        assert a.split("=", 1)[0] in known, a
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    cmd = yaml.safe_load(re.search(r"^CMD (\[.*\])$", docker, re.M).group(1))
    check_flags(cmd)
    assert "--kv-cache-fraction=0.9" in cmd and "--kv-cache-fraction=0.9" in container_args


def _alerts():
    return [r for g in _by_kind("PrometheusRule")["spec"]["groups"] for r in g["rules"]
            if "alert" in r]


def _promtool(*args, cwd):
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus): scripts/install-deps.sh"
    r = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_the_attnd_down_alert_fires_for_a_failing_pod_and_for_no_target(tmp_path):
    """promtool's rule tests: one of two pods failing its scrapes fires AttndDown after 5 minutes
    (not before, not for the healthy one); no attnd target at all fires it too; another job's
    targets do not count."""
    (tmp_path / "rules.yaml").write_text(
        yaml.safe_dump({"groups": _by_kind("PrometheusRule")["spec"]["groups"]}))
    down = next(r for r in _alerts() if r["alert"] == "AttndDown")
    common = {k: v for k, v in down["annotations"].items() if k != "summary"}
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [
        {"interval": "1m",
         "input_series": [
             {"series": 'up{job="attnd", namespace="ml", pod="attnd-0"}', "values": "1x15"},
             {"series": 'up{job="attnd", namespace="ml", pod="attnd-1"}', "values": "1x4 0x10"}],
         "alert_rule_test": [
             {"eval_time": "8m", "alertname": "AttndDown", "exp_alerts": []},
             {"eval_time": "12m", "alertname": "AttndDown", "exp_alerts": [{
                 "exp_labels": {"severity": "critical", "job": "attnd", "namespace": "ml",
                                "pod": "attnd-1"},
                 "exp_annotations": {**common,
                                     "summary": "attnd down: ml/attnd-1 fails its scrape"}}]}]},
        {"interval": "1m",
         "input_series": [{"series": 'up{job="node-exporter", pod="n"}', "values": "1x15"}],
         "alert_rule_test": [
             {"eval_time": "3m", "alertname": "AttndDown", "exp_alerts": []},
             {"eval_time": "10m", "alertname": "AttndDown", "exp_alerts": [{
                 "exp_labels": {"severity": "critical", "job": "attnd"},
                 "exp_annotations": {**common,
                                     "summary": "attnd down: no attnd target is scraped"}}]}]},
    ]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    assert "SUCCESS" in _promtool("test", "rules", "tests.yaml", cwd=tmp_path)


def _anchors(markdown):
    """GitHub's anchors of a Markdown file's headings."""
    return {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, re.M)}


def test_every_alert_links_a_runbook_section_that_exists():
    alerts = _alerts()
    assert "AttndDown" in {a["alert"] for a in alerts}
    anchors = _anchors(RUNBOOKS.read_text())
    for a in alerts:
        url = a["annotations"].get("runbook_url", "")
        assert url == f"docs/lifecycle.md#{a['alert'].lower()}", (a["alert"], url)
        assert url.split("#")[1] in anchors, f"{url}: no such section in {RUNBOOKS.name}"


def test_every_dashboard_query_filters_on_the_namespace_job_and_pod_variables(tmp_path):
    """Each metric every panel reads carries namespace=~"$namespace", job=~"$job" and
    pod=~"$pod", so another job's processes never mix in; the variables exist, offer All, and
    every query is PromQL once Grafana fills them in (promtool reads them as recording rules)."""
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    for name in ("namespace", "job", "pod"):
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["allValue"] == ".*", v
        assert DASHBOARD_ALL[f"${name}"] == v["allValue"]
    want = ('namespace=~"$namespace"', 'job=~"$job"', 'pod=~"$pod"')
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    for expr in exprs:
        uses = re.findall(r"\b((?:attnd|process)_[a-z_]+)(\{[^}]*\})?", expr)
        assert uses, expr
        for name, selector in uses:
            for matcher in want:
                assert matcher in selector, f"{name} in {expr!r} lacks {matcher}"
    for name in ("namespace", "job", "pod"):  # label_values(SELECTOR, LABEL) as PromQL
        selector, label = re.fullmatch(r"label_values\((.+), (\w+)\)",
                                       variables[name]["definition"]).groups()
        assert label == name
        exprs.append(f"group by ({label}) ({selector})")
    records = [{"record": f"dashboard:query_{i}", "expr": dashboard_query(e)}
               for i, e in enumerate(exprs)]
    (tmp_path / "queries.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    assert f"SUCCESS: {len(records)} rules found" in _promtool("check", "rules", "queries.yaml",
                                                              cwd=tmp_path)
