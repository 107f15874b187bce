"""A network namespace joined to this one by a veth pair, for tests that cut a process off the
network while it runs (test_partition.py, test_data_plane_unreachable.py). Needs root and
iproute2's `ip netns`; ``netns_available()`` says whether this machine allows both."""

from __future__ import annotations

import os
import shutil
import subprocess


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def netns_available() -> bool:
    """Whether this process may make a network namespace and a veth pair (root, iproute2, a
    kernel and container that allow both)."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        return False
    ns, dev = f"attnd-probe-{os.getpid()}", f"apr{os.getpid() % 100000}"
    try:
        ok = subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode == 0
        ok = ok and subprocess.run(["ip", "link", "add", dev, "type", "veth", "peer", "name",
                                    dev + "p", "netns", ns], capture_output=True).returncode == 0
        return ok
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", dev], capture_output=True)


class Netns:
    """A network namespace joined to this one by a veth pair: ``inside`` is its address there,
    ``outside`` this namespace's end of the link (a /30 of 10.213.0.0/16 chosen by the pid)."""

    def __init__(self) -> None:
        pid = os.getpid()
        n = pid % 16384  # one of the /16's 16384 /30s: test workers (pytest -n) differ by pid
        self.name = f"attnd-part-{pid}"
        self.outer, self.inner = f"apo{pid % 100000}", f"api{pid % 100000}"
        net = f"10.213.{n // 64}"
        self.outside, self.inside = f"{net}.{n % 64 * 4 + 1}", f"{net}.{n % 64 * 4 + 2}"
        _ip("netns", "add", self.name)
        try:
            _ip("link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
            _ip("link", "set", self.inner, "netns", self.name)
            _ip("addr", "add", f"{self.outside}/30", "dev", self.outer)
            _ip("link", "set", self.outer, "up")
            _ip("-n", self.name, "addr", "add", f"{self.inside}/30", "dev", self.inner)
            _ip("-n", self.name, "link", "set", self.inner, "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def run_inside(self) -> list:
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        """The link down at the namespace's end: packets to it vanish, its own fail at once."""
        _ip("-n", self.name, "link", "set", self.inner, "down")

    def heal(self) -> None:
        _ip("-n", self.name, "link", "set", self.inner, "up")

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True)
