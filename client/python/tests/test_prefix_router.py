"""The prefix router's rule (docs/prefix_cache.md#routing), without servers: the weighted score of
cached blocks, free room and work; unreachable replicas last; equal scores to the rendezvous owner;
the cases both clients must choose alike (tests/data/prefix_scores.txt, which
tests/unit/router_test.cc reads too); the room a choice takes counted before the next ServerInfo."""

from __future__ import annotations

import pytest

from attnd import PrefixRouter, PrefixWeights, ReplicaLoad, route, score_replicas

from attnd_process import ROOT


def test_the_score_weighs_the_cached_prompt_against_room_and_work():
    with pytest.raises(ValueError):
        score_replicas([], 4, "s")
    up = ReplicaLoad(50, 100, 0)
    assert score_replicas([("a", 2, up), ("b", 3, up), ("c", 1, up)], 4, "s") == "b"
    # A replica that did not answer loses to any that did, whatever it holds.
    assert score_replicas([("a", 0, ReplicaLoad(0, 100, 5)), ("b", 4, ReplicaLoad(-1, 0))],
                          4, "s") == "a"
    assert score_replicas([("a", 1, ReplicaLoad(-1, 0)), ("b", 4, ReplicaLoad(-1, 0))],
                          4, "s") == "b"
    # The defaults (cache 1, free 2): 1 of 8 blocks (0.125) + 60% free (1.2) loses to 90% free
    # (1.8); 7 of 8 (0.875 + 1.2) wins against it.
    roomy = ("b", 0, ReplicaLoad(90, 100, 0))
    assert score_replicas([("a", 1, ReplicaLoad(60, 100, 0)), roomy], 8, "s") == "b"
    assert score_replicas([("a", 7, ReplicaLoad(60, 100, 0)), roomy], 8, "s") == "a"
    # Work: equal cache and room, 3 open steps against none.
    assert score_replicas([("a", 2, ReplicaLoad(50, 100, 3)), ("b", 2, up)], 4, "s") == "b"
    # The cache alone: room and work change nothing.
    assert score_replicas([("a", 2, ReplicaLoad(0, 100, 9)), ("b", 1, ReplicaLoad(100, 100, 0))],
                          4, "s", PrefixWeights(1.0, 0.0, 0.0)) == "a"
    for i in range(32):
        same = [(n, 0, ReplicaLoad(5, 10, 0)) for n in "abc"]
        assert score_replicas(same, 0, f"s{i}") == route(list("abc"), f"s{i}")


def test_both_clients_choose_alike_on_the_recorded_cases():
    cases = 0
    for line in (ROOT / "tests" / "data" / "prefix_scores.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        sid, blocks, wc, wf, wl, want, *cands = line.split()
        candidates = []
        for c in cands:
            name, cached, free, total, busy = c.split(":")
            candidates.append((name, int(cached), ReplicaLoad(int(free), int(total), int(busy))))
        weights = PrefixWeights(float(wc), float(wf), float(wl))
        assert score_replicas(candidates, int(blocks), sid, weights) == want, line
        cases += 1
    assert cases >= 50


class _Info:
    """ServerInfo's fields the router reads."""

    def __init__(self, free, total, busy):
        from attnd import DeviceInfo, LoadInfo
        self.devices = [DeviceInfo("cpu:0", total, free, 0, 0)]
        self.load = LoadInfo(busy, 0, 0)


def test_a_choice_takes_its_pages_off_the_free_room_until_the_next_server_info(monkeypatch):
    # Two empty replicas of 100 pages, prompts of 40 pages, nothing cached anywhere (a router
    # that asks: no events): the first prompt goes to its rendezvous owner; within the load's
    # time to live, the second sees that owner 40 pages fuller and goes to the other.
    router = PrefixRouter({"a": "127.0.0.1:1", "b": "127.0.0.1:2"}, block_size=16,
                          load_ttl_s=60.0)
    asked = []
    monkeypatch.setattr(router, "cached_blocks", lambda name, hashes: 0)

    class Fake:
        def __init__(self, name):
            self.name = name

        def info(self):
            asked.append(self.name)
            return _Info(100, 100, 0)

    monkeypatch.setattr(router, "client", lambda name: Fake(name))
    tokens = list(range(40 * 16))
    first, cached = router.choose("x", tokens)
    assert cached == 0 and first == route(["a", "b"], "x")
    second, _ = router.choose("y", tokens)
    assert second != first
    assert sorted(asked) == ["a", "b"], "asked again within the time to live"
    assert router.load(first).free_pages == 60
    # An older load callable's (room, open steps): read with no room term.
    old = PrefixRouter({"a": "x", "b": "y"}, block_size=16,
                       load=lambda n: (0, 3 if n == "a" else 0))
    assert old.load("a") == ReplicaLoad(0, 0, 3)
    assert old.load("b") == ReplicaLoad(0, 0, 0)
