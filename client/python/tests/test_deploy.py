"""The Kubernetes manifests agree with the server: probe names, ports and flags."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]


def test_manifests_probe_the_right_health_names_and_ports():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "attnd.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Service", "StatefulSet", "ServiceMonitor", "PodDisruptionBudget"}
    assert kinds["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1
    assert kinds["Service"]["spec"]["clusterIP"] == "None"  # headless: clients hash over pods
    pod = kinds["StatefulSet"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["readinessProbe"]["grpc"]["service"] == "attnd.v1.Attention"
    assert c["livenessProbe"]["grpc"]["service"] == ""
    assert c["startupProbe"]["grpc"]["port"] == 50051
    args = dict(a[2:].split("=", 1) for a in c["args"])
    assert args["grpc-port"] == "50051" and args["metrics-port"] == "8002"
    # The drain (open steps, then every sequence handed off) and the shutdown fit in the grace.
    assert args["drain-peers"].startswith("dns:attnd:")
    assert pod["terminationGracePeriodSeconds"] * 1000 > (int(args["drain-timeout-ms"]) +
                                                          int(args["shutdown-grace-ms"]))
    assert kinds["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == "metrics"
    assert kinds["ServiceMonitor"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    for d in docs:
        assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "attnd", d["kind"]
    assert kinds["Service"]["spec"]["ports"][0]["appProtocol"] == "grpc"
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert pod["securityContext"]["runAsNonRoot"]
    assert pod["affinity"]["podAntiAffinity"]


def test_dockerfile_has_labels_a_healthcheck_and_an_ignore_file():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "org.opencontainers.image.revision" in text
    assert 'HEALTHCHECK' in text and '"health"' in text
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert "build*/" in ignore and ".git/" in ignore
