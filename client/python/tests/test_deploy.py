"""The deployment files: the Kubernetes manifests validated offline against the Kubernetes API's
own schemas (kubernetes-validate, strict: unknown fields are errors), checked to wire together
(selectors, ports, probes, the flags attnd accepts), and the Dockerfile's command line parsed by
the attnd that was built."""

from __future__ import annotations

import copy
import re
import subprocess

import kubernetes_validate
import pytest
import yaml

from attnd_process import ATTND_BIN, ROOT

MANIFESTS = ROOT / "deploy" / "kubernetes" / "attnd.yaml"
RULES = ROOT / "deploy" / "prometheus" / "attnd-rules.yaml"
# The oldest Kubernetes the manifests are for (gRPC probes are GA from 1.27) and the newest whose
# schemas kubernetes-validate carries.
VERSIONS = ["1.28.0", kubernetes_validate.latest_version()]
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}  # CRDs: no schema in the Kubernetes API


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
    kinds = []
    for doc in _docs():
        if doc["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(doc, version, strict=True)
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["PodDisruptionBudget", "Service", "StatefulSet"]


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
