"""The chart's NetworkPolicy (deploy/helm/attnd, networkPolicy): each port admitted only to the
peers listed for it, the pods to each other on grpc, the data plane's every-port rule only with
the plane on (UCX trusts its peers: docs/trust.md), and no list ever rendered as a rule without
peers, which Kubernetes reads as "from anywhere". Validation against the API's schemas, the
refusals and the other renderers are test_helm's and test_helm_renderers' (the all-on variant)."""

from __future__ import annotations

import kubernetes_validate
import pytest
from test_deploy import VERSIONS
from test_helm import _render

WORKERS = [{"podSelector": {"matchLabels": {"app": "model-worker"}}}]
SCRAPERS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
ROUTERS = [{"podSelector": {"matchLabels": {"app": "router"}}},
           {"ipBlock": {"cidr": "10.20.0.0/16"}}]
FABRIC = [{"namespaceSelector": {"matchLabels": {"fabric": "trusted"}},
           "podSelector": {"matchLabels": {"app": "model-worker"}}}]
SELF = {"app.kubernetes.io/name": "attnd", "app.kubernetes.io/instance": "attnd"}


def _rules(values):
    """The policy's ingress rules as (ports, peers): ports a sorted tuple of names (None: every
    port), peers the list as rendered."""
    docs = _render(values)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    if not values.get("networkPolicy", {}).get("enabled"):
        assert not policies
        return None
    assert len(policies) == 1, [d["kind"] for d in docs]
    spec = policies[0]["spec"]
    assert spec["policyTypes"] == ["Ingress"]  # egress is the cluster's to restrict
    assert spec["podSelector"] == {"matchLabels": SELF}
    rules = []
    for rule in spec["ingress"]:
        assert rule.get("from"), rule  # an empty or missing from admits every peer
        ports = rule.get("ports")
        if ports is not None:
            assert all(p["protocol"] == "TCP" for p in ports), ports
        rules.append((None if ports is None else tuple(sorted(p["port"] for p in ports)),
                      rule["from"]))
    return rules


def test_the_chart_makes_no_policy_unless_asked():
    assert _rules({}) is None
    assert _rules({"networkPolicy": {"clients": WORKERS}}) is None


def test_each_port_admits_only_the_peers_listed_for_it():
    rules = _rules({"networkPolicy": {"enabled": True, "clients": WORKERS, "metrics": SCRAPERS,
                                      "kvEvents": ROUTERS, "dataPlane": FABRIC},
                    "kvEvents": {"enabled": True}, "dataPlane": {"enabled": True}})
    assert rules == [
        (("grpc",), [{"podSelector": {"matchLabels": SELF}}]),  # drains, standby copies
        (("grpc",), WORKERS),
        (("metrics",), SCRAPERS),
        (("kv-events", "kv-replay"), ROUTERS),
        (None, FABRIC),  # the data plane: every port, UCX picks them
    ]


def test_a_list_left_empty_admits_no_one_there():
    """Nothing scrapes without metrics peers, and a data plane with no peers listed serves only
    the pod's own containers: neither becomes a rule (which would admit everyone)."""
    rules = _rules({"networkPolicy": {"enabled": True, "clients": WORKERS},
                    "dataPlane": {"enabled": True}})
    assert rules == [(("grpc",), [{"podSelector": {"matchLabels": SELF}}]), (("grpc",), WORKERS)]


def test_ports_of_features_turned_off_are_not_opened():
    """Peers listed for the KV events or the data plane reach nothing while those are off; the
    replay port only where it is on."""
    off = _rules({"networkPolicy": {"enabled": True, "clients": WORKERS, "kvEvents": ROUTERS,
                                    "dataPlane": FABRIC}})
    assert [ports for ports, _ in off] == [("grpc",), ("grpc",)]
    no_replay = _rules({"networkPolicy": {"enabled": True, "clients": WORKERS,
                                          "kvEvents": ROUTERS},
                        "kvEvents": {"enabled": True, "replayPort": 0}})
    assert (("kv-events",), ROUTERS) in no_replay


@pytest.mark.parametrize("version", VERSIONS)
def test_the_policy_validates_strictly_with_every_list_filled(version):
    docs = _render({"networkPolicy": {"enabled": True, "clients": WORKERS, "metrics": SCRAPERS,
                                      "kvEvents": ROUTERS, "dataPlane": FABRIC},
                    "kvEvents": {"enabled": True}, "dataPlane": {"enabled": True}})
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
    kubernetes_validate.validate(policy, version, strict=True)
