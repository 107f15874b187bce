"""attnd's exposition keeps its families: every metric's name, type and label names after a fixed
workload, compared with tests/data/metric_families.txt (recorded from the hand-written registry
before /metrics moved onto prometheus-cpp). Dashboards, alerts and recording rules written against
one release read the next; a family may be added to the file, never renamed or dropped."""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
import pytest

from attnd import AttndClient, AttndError

from attnd_process import ROOT, running
from attnd_testlib import layer_inputs, scrape, step_details

RECORDED = ROOT / "tests" / "data" / "metric_families.txt"
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? \S+$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*",?')


def families(text: str) -> dict[str, str]:
    """name -> "type label,names|other,names" for every family with a sample ("-": no labels)."""
    types: dict[str, str] = {}
    label_sets: dict[str, set[str]] = defaultdict(set)
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, inner = m.group(1), m.group(2) or ""
        names = LABEL.findall(inner)
        assert LABEL.sub("", inner) == "", f"labels not parsed: {line!r}"
        family = name
        for suffix in ("_bucket", "_sum", "_count"):
            base = name.removesuffix(suffix)
            if base != name and types.get(base) == "histogram":
                family = base
        assert family in types, f"{name} has no # TYPE line"
        label_sets[family].add(",".join(sorted(set(names) - {"le"})) or "-")
    return {n: f"{types[n]} {'|'.join(sorted(label_sets[n]))}" for n in sorted(label_sets)}


def recorded() -> dict[str, str]:
    out = {}
    for line in RECORDED.read_text().splitlines():
        if line and not line.startswith("#"):
            name, rest = line.split(" ", 1)
            out[name] = rest
    return out


def test_the_parser_sees_names_types_and_label_names():
    text = ('# TYPE a_total counter\na_total{x="1",y="q\\"u, o=te"} 1\na_total 2\n'
            '# TYPE h histogram\nh_bucket{le="0.5",k="v"} 1\nh_bucket{le="+Inf",k="v"} 1\n'
            'h_sum{k="v"} 0.1\nh_count{k="v"} 1\n')
    assert families(text) == {"a_total": "counter -|x,y", "h": "histogram k"}
    with pytest.raises(AssertionError):
        families("a_total 1\n")  # no TYPE line


def test_the_exposition_has_the_recorded_families():
    rng = np.random.default_rng(52)
    with running([]) as (_, target, mport), AttndClient(target, timeout=30) as c:
        spec = c.info().model
        c.open_sequence("fam")
        step_details(c, [("fam", 3)], layer_inputs(spec, 3, rng))  # prefill, unary
        with c.stream() as s:  # decode, streamed
            s.begin([("fam", 1)])
            for x in layer_inputs(spec, 1, rng):
                s.layer_details(x)
        with pytest.raises(AttndError):  # an error: attnd_rpc_errors_total has a series
            c.describe_sequence("fam-no-such-sequence")
        c.close_sequence("fam")
        now = families(scrape(mport))
    want = recorded()
    missing = {n: t for n, t in want.items() if now.get(n) != t}
    assert not missing, f"families changed or gone: {missing}\nnow: " + "".join(
        f"\n{n} {now.get(n)}" for n in missing)
    added = sorted(set(now) - set(want))
    assert not added, f"new families, add them to {RECORDED.name}: " + "".join(
        f"\n{n} {now[n]}" for n in added)
