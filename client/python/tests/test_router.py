"""Rendezvous routing in Python agrees with the C++ client (pinned in tests/unit/router_test.cc) and
moves only the sequences of a replica that leaves."""

from collections import Counter

from attnd.router import rendezvous_weight, resolve_endpoints, route

EPS = [f"10.0.0.{i + 1}:50051" for i in range(3)]


def test_weights_match_the_cpp_client():
    assert rendezvous_weight("10.0.0.1:50051", "req-1") == 0x8BF57D503040D621
    assert rendezvous_weight("10.0.0.3:50051", "decode/42") == 0x4B2D243253B373A9
    assert route(EPS, "req-1") == "10.0.0.1:50051"
    assert route(EPS, "req-2") == "10.0.0.2:50051"
    assert route([], "x") is None


def test_even_spread_and_minimal_movement():
    eps = [f"10.0.0.{i + 1}:50051" for i in range(5)]
    counts = Counter(route(eps, f"req-{i}") for i in range(10000))
    assert len(counts) == 5 and all(abs(n - 2000) < 250 for n in counts.values()), counts
    fewer = eps[:2] + eps[3:]
    for i in range(2000):
        before = route(eps, f"s{i}")
        if before != eps[2]:
            assert route(fewer, f"s{i}") == before


def test_resolve_localhost():
    assert resolve_endpoints("localhost", 50051)
