"""The Helm chart rendered by other implementations of Go templates than helm_render: Go's own
text/template where `go` is installed (deploy/helm/gorender, the engine Helm runs, with the few
Sprig/Helm functions the chart uses written there), and `helm lint` / `helm template` where `helm`
is installed; each must make the same objects (and notes) as helm_render for every variant of
test_helm, and refuse what it refuses."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import yaml
from helm_render import Chart, Fail
from test_helm import CHART, CLUSTERS, GO, HELM, VARIANTS, _defaults, _render, _variant

from attnd_process import ROOT


def _key(doc):
    return (doc["kind"], doc["metadata"]["name"])


@pytest.mark.skipif(HELM is None, reason="helm is not installed: helm_render's check only")
@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lints_and_renders_the_same_objects(variant, tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(VARIANTS[variant]))
    apis = [a for v in CLUSTERS.get(variant, ()) for a in ("--api-versions", v)]
    subprocess.run([HELM, "lint", "--strict", str(CHART), "-f", str(values)], check=True)
    out = subprocess.run([HELM, "template", "attnd", str(CHART), "-f", str(values), *apis],
                         check=True, capture_output=True, text=True).stdout
    helm_docs = sorted((d for d in yaml.safe_load_all(out) if d), key=_key)
    assert helm_docs == sorted(_variant(variant), key=_key)


@pytest.fixture(scope="module")
def gorender(tmp_path_factory):
    """deploy/helm/gorender built with the machine's Go (the standard library only, offline)."""
    if GO is None:
        pytest.skip("go is not installed (Debian: golang-go): the chart is rendered by "
                    "helm_render alone, not cross-checked with Go's text/template")
    d = tmp_path_factory.mktemp("gorender")
    env = dict(os.environ, GOFLAGS="", GOTOOLCHAIN="local")  # the machine's Go, nothing fetched
    if not (env.get("GOCACHE") or env.get("HOME") or env.get("XDG_CACHE_HOME")):
        env["GOCACHE"] = str(d / "cache")
    r = subprocess.run([GO, "build", "-o", str(d / "gorender"), "main.go"], env=env,
                       cwd=ROOT / "deploy" / "helm" / "gorender", capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (d / "defaults.json").write_text(json.dumps(_defaults()))

    def run(values, api_versions=(), notes=False):
        (d / "values.json").write_text(json.dumps(values))
        return subprocess.run(
            [str(d / "gorender"), "-chart", str(CHART), "-defaults", str(d / "defaults.json"),
             "-values", str(d / "values.json"), "-api-versions", ",".join(api_versions),
             *(["-notes"] if notes else [])], capture_output=True, text=True)

    return run


@pytest.mark.parametrize("variant", VARIANTS)
def test_go_text_template_makes_the_same_objects_and_notes(variant, gorender):
    """Go's own template engine (the one Helm runs; the few Sprig/Helm functions written in
    gorender) and helm_render agree on every object and on the notes, byte for byte."""
    values, apis = VARIANTS[variant], CLUSTERS.get(variant, ())
    r = gorender(values, apis)
    assert r.returncode == 0, r.stderr
    go_docs = sorted((d for d in yaml.safe_load_all(r.stdout) if d), key=_key)
    assert go_docs == sorted(_render(values, apis), key=_key)
    r = gorender(values, apis, notes=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout == Chart(CHART).notes(values, api_versions=apis)


@pytest.mark.parametrize("values, message", [
    ({"tls": {"clientAuth": True}}, "tls.clientAuth needs tls.enabled"),
    ({"tiers": {"spillIdleMs": 1000}}, "tiers.spillIdleMs needs a tier to spill to"),
])
def test_go_text_template_refuses_what_helm_render_refuses(values, message, gorender):
    with pytest.raises(Fail, match=re.escape(message)):
        _render(values)
    r = gorender(values)
    assert r.returncode == 1 and message in r.stderr, r.stderr
